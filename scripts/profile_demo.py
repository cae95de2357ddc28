"""Profile the demo (``loopvq-calibrate --config configs/tiny-ouro.yaml``) in this process: per stage the wall
time and the CPU time of the whole process (user + sys, all threads), the thread settings of torch, faiss and
the OpenMP environment, and with ``--cprofile N`` each stage's N functions of largest own time. One JSON
document on stdout or in ``--report`` (docs/performance.md quotes it). On a shared machine compare CPU seconds: wall time then
measures the neighbours.

    python scripts/profile_demo.py --output /tmp/demo-profile --report profile.json [--cprofile 15] [--set kmeans.iterations=20]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import re
import subprocess
import time
from pathlib import Path
from typing import Any

STAGE = re.compile(r"stage (\w+): (running|done)")


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _threads() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
                           "cpus": os.cpu_count(), "env": {k: v for k, v in os.environ.items() if re.search("OMP|MKL|OPENBLAS", k)}}
    try:
        import faiss

        out["faiss_omp_threads"] = faiss.omp_get_max_threads()
    except ImportError:
        out["faiss_omp_threads"] = None
    return out


class StageClock(logging.Filter):
    """Stage boundaries from the run's log lines (a filter on the logger, which outlives the run's handler
    setup): wall and CPU seconds per stage, optionally a cProfile each."""

    def __init__(self, top: int) -> None:
        super().__init__()
        self.top, self.stages, self.current, self.profile = top, {}, None, None

    def filter(self, record: logging.LogRecord) -> bool:
        m = STAGE.match(record.getMessage())
        if m:
            self._mark(*m.groups())
        return True

    def _mark(self, name: str, what: str) -> None:
        if what == "running":
            self.current = (name, time.perf_counter(), _cpu_s())
            if self.top:
                self.profile = cProfile.Profile()
                self.profile.enable()
            return
        if self.profile is not None:
            self.profile.disable()
        _, wall0, cpu0 = self.current
        entry = {"wall_s": round(time.perf_counter() - wall0, 2), "cpu_s": round(_cpu_s() - cpu0, 2)}
        if self.profile is not None:
            stats = pstats.Stats(self.profile)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: self.top]
            entry["top_own_s"] = [[f"{Path(f).name}:{line}:{fn}", round(tt, 2), round(ct, 2)] for (f, line, fn), (_, _, tt, ct, _) in rows]
            self.profile = None
        self.stages[name] = entry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny-ouro.yaml")
    p.add_argument("--output", required=True, help="a fresh run directory (a reused stage is not timed)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="each stage's N functions of largest own time")
    p.add_argument("--report", help="write the JSON document here (default: stdout, after the run's own lines)")
    args = p.parse_args()
    start_wall, start_cpu = time.perf_counter(), _cpu_s()
    from loopvq_calib.cli import calibrate_main

    clock = StageClock(args.cprofile)
    logging.getLogger("loopvq_calib").addFilter(clock)
    argv = ["--config", args.config, "--output", args.output] + [a for o in args.overrides for a in ("--set", o)]
    status = calibrate_main(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    manifest = json.loads((Path(args.output) / "manifest.json").read_text())
    curve = manifest.get("finetune_curve") or []
    report = json.dumps({
        "commit": commit, "command": "python scripts/profile_demo.py " + " ".join(argv), "status": status,
        "threads": _threads(), "stages": clock.stages,
        "total": {"wall_s": round(time.perf_counter() - start_wall, 2), "cpu_s": round(_cpu_s() - start_cpu, 2)},
        "selection_kl": {"kmeans": curve[0]["selection_kl"] if curve else None,
                         "finetuned": min((c["selection_kl"] for c in curve), default=None)},
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }, indent=1)
    if args.report:
        Path(args.report).write_text(report + "\n")
    else:
        print(report)


if __name__ == "__main__":
    main()
