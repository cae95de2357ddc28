"""How long a process like ``loopvq-calibrate`` takes to exit after its work is done: a child imports what the
command imports, holds ``--gib`` of GPU memory in torch's caching allocator (as the fine-tuning stage leaves
it), prints a time stamp and exits, normally or through ``os._exit`` after flushing (``--fast``). Prints one
JSON line per way: seconds from the stamp to the child's end, as the parent sees it.

    python scripts/probe_exit.py --gib 50
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time, torch
from loopvq_calib.calibration.pipeline import Pipeline  # noqa: F401  (the command's imports)
gib, fast = float(sys.argv[1]), sys.argv[2] == "fast"
if torch.cuda.is_available():
    blocks = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(int(gib))]
    torch.cuda.synchronize()
print(time.time(), flush=True)
if fast:
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=50.0)
    args = ap.parse_args()
    for way in ("normal", "fast"):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(args.gib), way], capture_output=True, text=True)
        end = time.time()
        stamp = float(proc.stdout.strip().splitlines()[-1])
        print(json.dumps({"exit": way, "gib": args.gib, "rc": proc.returncode, "exit_s": round(end - stamp, 3)}), flush=True)


if __name__ == "__main__":
    main()
