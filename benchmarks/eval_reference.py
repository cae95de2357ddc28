"""benchmarks/eval_reference.py: served-cache results on the shipped reference model, every method and width plus
the baselines.

Calibrates one bundle per method (cq, tasq, loopvq, tasq+loopvq) and width (0.5 / 0.25 bit) with the setup
of benchmarks/reproduce.py (16 x 192 tokens of Hamlet + Macbeth, k-means 10 iterations) but 2 fine-tuning epochs
(bundles under runs/eval-reference/, reused when present), then runs ``loopvq-eval`` once on all of them with
the baselines, the shipped local task and passkey retrieval. The report goes to benchmarks/results/eval-reference/,
with ``setup.json`` (the command, the commit, the calibration settings) beside it; benchmarks/reproduce_report.py puts
its served-cache table in docs/quality.md.

    python benchmarks/eval_reference.py                   # about 40 minutes on 2 shared CPU cores
    python benchmarks/eval_reference.py --limit 8 --passkey-lengths 128 --out /tmp/quick   # a smoke run
    python benchmarks/eval_reference.py --recent-window 0 --passkey-lengths "" --kl-sequences 1 \
        --out benchmarks/results/eval-reference-window0       # every token after the sinks read from codes
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: local models and data only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

from loopvq_calib import calibrate
from loopvq_calib.cli import eval_main
from loopvq_calib.config.schema import FinetuneConfig

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


def setup(argv: list[str]) -> dict:
    """What setup.json records: the command, the commit, the machine's cores and the calibration settings."""
    cfg = run_config("loopvq", 0.5)
    data, quant = cfg["data"], cfg["quant"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    calibration = {"dataset": str(Path(data["dataset"]).relative_to(ROOT)), "sequences": data["num_sequences"],
                   "sequence_length": data["sequence_length"], "selection_sequences": data["heldout_sequences"],
                   "sink_tokens": data["sink_tokens"], "codebook_size": quant["codebook_size"],
                   "group_size": {f"{bits:g}": group for bits, group in WIDTHS.items()},
                   "steps_per_block": quant["steps_per_block"], "kmeans_iterations": cfg["kmeans"]["iterations"],
                   "finetune": asdict(FinetuneConfig(**cfg["finetune"])), "serving": cfg["output"]["serving"]}
    return {"command": shlex.join(["python", "benchmarks/eval_reference.py", *argv]),
            "commit": commit.stdout.strip() or None, "cpu_count": os.cpu_count(), "calibration": calibration}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval-reference"))
    p.add_argument("--limit", type=float, help="items of the local task (default: all 44)")
    p.add_argument("--passkey-lengths", default="256,1024,2000")
    p.add_argument("--passkey-trials", type=int, default=2)
    p.add_argument("--recent-window", type=int, help="override the bundles' 64-token window (every entry)")
    p.add_argument("--kl-sequences", type=int, default=8, help="held-out windows of 512 tokens for the KL")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    paths = bundles(args.workers)
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
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "setup.json").write_text(json.dumps(setup(sys.argv[1:]), indent=1) + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
