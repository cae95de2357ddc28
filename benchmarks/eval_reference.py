"""Served-cache results on the shipped reference model: every method and width plus the baselines.

Calibrates one bundle per method (cq, tasq, loopvq, tasq+loopvq) and width (0.5 / 0.25 bit) with the setup
of benchmarks/reproduce.py (16 x 192 tokens of Hamlet + Macbeth, k-means 10 iterations) but 2 fine-tuning epochs
(bundles under runs/eval-reference/, reused when present), then runs ``loopvq-eval`` once on all of them with
the baselines, the shipped local task and passkey retrieval. The report goes to benchmarks/results/eval-reference/.

    python benchmarks/eval_reference.py                   # about 40 minutes on 2 shared CPU cores
    python benchmarks/eval_reference.py --limit 8 --passkey-lengths 128 --out /tmp/quick   # a smoke run
    python benchmarks/eval_reference.py --recent-window 0 --passkey-lengths "" --kl-sequences 1 \
        --out benchmarks/results/eval-reference-window0       # every token after the sinks read from codes
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "eval-reference"
METHODS = ("cq", "tasq", "loopvq", "tasq+loopvq")
WIDTHS = {0.5: 16, 0.25: 32}
BASELINES = "last-step-kv,kivi2,kivi4,fp8"


def run_config(method: str, bits: float) -> dict:
    return {
        "model": {"name_or_path": str(ROOT / "artifacts/tiny-ouro")},
        "data": {"dataset": str(ROOT / "artifacts/data/shakespeare-calib.jsonl"), "num_sequences": 16,
                 "sequence_length": 192, "heldout_sequences": 4, "sink_tokens": 8},
        "quant": {"method": method, "bits": bits, "group_size": WIDTHS[bits], "codebook_size": 256,
                  "steps_per_block": 4},
        "kmeans": {"iterations": 10},
        "finetune": {"epochs": 2, "lr": 1e-3},
        "output": {"serving": {"recent_window": 64, "page_size": 8}},
    }


def _calibrate(name: str, cfg: dict) -> tuple[str, float]:
    import torch

    from loopvq_calib import calibrate

    torch.set_num_threads(1)
    start = time.time()
    calibrate(cfg, output=RUNS / name)
    return name, time.time() - start


def bundles(workers: int) -> list[Path]:
    """One bundle per method and width (calibrated unless already there)."""
    todo = {f"{m}-{b}": run_config(m, b) for b in WIDTHS for m in METHODS}
    missing = [(n, c) for n, c in todo.items() if not (RUNS / n / "bundle" / "loopvq.json").is_file()]
    if missing:
        with ProcessPoolExecutor(workers) as pool:
            for name, seconds in pool.map(_calibrate, *zip(*missing)):
                print(f"calibrated {name} in {seconds:.0f} s", flush=True)
    return [RUNS / n / "bundle" for n in todo]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "data" / "eval-reference"))
    p.add_argument("--limit", type=float, help="items of the local task (default: all 44)")
    p.add_argument("--passkey-lengths", default="256,1024,2000")
    p.add_argument("--passkey-trials", type=int, default=2)
    p.add_argument("--recent-window", type=int, help="override the bundles' 64-token window (every entry)")
    p.add_argument("--kl-sequences", type=int, default=8, help="held-out windows of 512 tokens for the KL")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    paths = bundles(args.workers)
    from loopvq_calib.cli import eval_main

    argv = [arg for b in paths for arg in ("--bundle", str(b))]
    argv += ["--model", str(ROOT / "artifacts/tiny-ouro"), "--dtype", "bfloat16", "--device", "cpu",
             "--num-sequences", str(args.kl_sequences), "--sequence-length", "512", "--tasks", "loopvq_kjv_phrases",
             "--baseline", BASELINES, "--passkey-lengths", args.passkey_lengths,
             "--passkey-trials", str(args.passkey_trials), "--out", args.out]
    if args.recent_window is not None:
        argv += ["--recent-window", str(args.recent_window)]
    if args.passkey_lengths == "":
        cut = argv.index("--passkey-lengths")
        del argv[cut:cut + 4]
    if args.limit:
        argv += ["--limit", f"{args.limit:g}"]
    start = time.time()
    status = eval_main(argv)
    print(f"loopvq-eval took {time.time() - start:.0f} s (status {status})")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
