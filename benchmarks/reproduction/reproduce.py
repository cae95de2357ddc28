"""Reproduce the paper's analyses on the shipped reference model: benchmarks/reproduction/reproduce.py gathers the
data (benchmarks/results/results.json) and writes docs/quality.md and docs/figures/
(benchmarks/reproduction/reproduce_report.py).

A thin driver over the pipeline (``loopvq_calib.calibrate``) and the evaluation (``evaluate_quantizers``):
every run is a normal run directory under runs/reproduce/, captures are shared between runs with the
same data (their fingerprints match, so the pipeline reuses them), and runs go two at a time on
single-threaded workers. Held-out text (artifacts/data/shakespeare-heldout.jsonl) is never used for
calibration.

    python benchmarks/reproduction/reproduce.py                 # about 16 minutes on 2 CPU cores
    python benchmarks/reproduction/reproduce.py --report-only   # rewrite quality.md and its figures from the results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: local models and data only
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from benchmarks.common.paths import ROOT
from benchmarks.common.provenance import short_commit
from benchmarks.reproduction.reproduce_figures import draw
from benchmarks.reproduction.reproduce_report import STUDY, write_page
from benchmarks.reproduction.reproduce_tables import METHODS
from loopvq_calib import calibrate
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.stages import load_quantizer
from loopvq_calib.config.schema import DataConfig, FinetuneConfig
from loopvq_calib.data.corpus import build_calibration_set
from loopvq_calib.evaluation.evaluate import evaluate_quantizers
from loopvq_calib.evaluation.kv_structure import average_structure, correlation_structure
from loopvq_calib.models.loading import load_model

RUNS = ROOT / "runs" / "reproduce"
PAGE = ROOT / "docs" / "quality.md"
FIGS = ROOT / "docs" / "figures"
WIDTHS = {0.5: 16, 0.25: 32}
CORPORA = {"shakespeare": "artifacts/data/shakespeare-calib.jsonl", "kjv": "artifacts/data/kjv-calib.jsonl"}
SEQ_LEN, KMEANS_ITERS, HELDOUT_SEQS, HELDOUT_LEN = 192, 10, 8, 512


def run_config(method: str, bits: float, corpus: str = "shakespeare", sequences: int = 16, fisher: bool = True) -> dict:
    return {
        "model": {"name_or_path": str(ROOT / "artifacts/tiny-ouro")},
        "data": {
            "dataset": str(ROOT / CORPORA[corpus]),
            "num_sequences": sequences,
            "sequence_length": SEQ_LEN,
            "heldout_sequences": sequences // 4,
            "sink_tokens": 8,
        },
        "quant": {
            "method": method,
            "bits": bits,
            "group_size": WIDTHS[bits],
            "codebook_size": 256,
            "steps_per_block": 4,
        },
        # on disk and per coordinate, so runs of one corpus share their capture (TaSQ methods share theirs)
        "capture": {"store": "disk", "fisher_channels": 1},
        "kmeans": {"iterations": KMEANS_ITERS, "fisher_weighted": fisher},
        "finetune": {},  # the shipped recipe (FinetuneConfig's defaults)
    }


def plan() -> list[tuple[str, dict, list[str] | None, str]]:
    """(run name, config, stages or None for all, capture key) for every run of the study."""
    runs = []
    for bits in WIDTHS:
        for method in METHODS:
            runs.append((f"{method}-{bits}", run_config(method, bits), None, "shakespeare-16"))
        for method in ("cq", "loopvq"):
            plain = run_config(method, bits, fisher=False)
            runs.append((f"{method}-{bits}-plain", plain, ["kmeans"], "shakespeare-16"))
    for n in (8, 32):
        runs.append((f"loopvq-0.25-n{n}", run_config("loopvq", 0.25, sequences=n), None, f"shakespeare-{n}"))
    for method in ("cq", "tasq+loopvq"):
        runs.append((f"{method}-0.25-kjv", run_config(method, 0.25, corpus="kjv"), None, "kjv-16"))
    return runs


def _worker_init() -> None:
    torch.set_num_threads(1)


def _calibrate(name: str, cfg: dict, stages: list[str] | None) -> tuple[str, float]:
    start = time.time()
    calibrate(cfg, output=RUNS / name, stages=stages)
    return name, time.time() - start


def share_capture(src: Path, dst: Path) -> None:
    """Give ``dst`` the data and capture stages of ``src`` (hard links + manifest records)."""
    if (dst / "capture").exists():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for stage in ("data", "capture"):
        shutil.copytree(src / stage, dst / stage, copy_function=os.link)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["stages"] = {k: v for k, v in manifest["stages"].items() if k in ("data", "capture")}
    (dst / "manifest.json").write_text(json.dumps(manifest))


def calibrate_all(workers: int) -> dict[str, float]:
    runs = plan()
    capture_runs = {}
    for name, cfg, _, key in runs:
        capture_runs.setdefault(key, (name, cfg))
    times = {}
    with ProcessPoolExecutor(workers, initializer=_worker_init) as pool:
        for name, t in pool.map(_calibrate, *zip(*[(n, c, ["capture"]) for n, c in capture_runs.values()])):
            times[f"{name} (capture)"] = t
        for name, _, _, key in runs:
            share_capture(RUNS / capture_runs[key][0], RUNS / name)
        for name, t in pool.map(_calibrate, *zip(*[(n, c, s) for n, c, s, _ in runs])):
            times[name] = t
    return times


def evaluate_all() -> dict:
    """Held-out metrics of every fine-tuned quantizer (with per-step sensitivity) and k-means quantizer."""
    model, tok = load_model(ROOT / "artifacts/tiny-ouro", "float32", torch.device("cpu"))
    held = build_calibration_set(
        DataConfig(
            dataset=str(ROOT / "artifacts/data/shakespeare-heldout.jsonl"),
            num_sequences=HELDOUT_SEQS,
            sequence_length=HELDOUT_LEN,
            heldout_sequences=0,
        ),
        tok,
    )
    entries, names = [], []
    for name, _, stages, _ in plan():
        for stage in ["kmeans"] if stages else ["kmeans", "finetune"]:
            entries.append((load_quantizer(RUNS / name / stage), 8))
            names.append((name, stage))
    results = {}
    per_step = [i for i, (name, stage) in enumerate(names) if stage == "finetune"]
    for subset, with_steps in ((per_step, True), ([i for i in range(len(names)) if i not in per_step], False)):
        metrics = evaluate_quantizers(model, held.input_ids, [entries[i] for i in subset], per_step=with_steps)
        for i, r in zip(subset, metrics):
            results[f"{names[i][0]}/{names[i][1]}"] = r
    reader = CaptureReader(RUNS / "cq-0.5" / "capture")
    kv = load_quantizer(RUNS / "cq-0.5" / "kmeans").kv
    structure = {}
    for kind in ("key", "value"):
        per_layer = [
            correlation_structure(reader.load(kind, tuple(s.site for s in kv.sites if s.layer == layer)))
            for layer in range(4)
        ]
        structure[kind] = average_structure(per_layer)
    curves = {
        name: json.loads((RUNS / name / "finetune" / "curve.json").read_text())
        for name, _, stages, _ in plan()
        if not stages
    }
    return {"metrics": results, "structure": structure, "curves": curves, "heldout": held.description}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite docs/quality.md and its figures from the stored benchmarks/results/results.json",
    )
    args = ap.parse_args()
    if not args.report_only:
        start = time.time()
        times = calibrate_all(args.workers)
        data = evaluate_all()
        data["times"], data["total_s"] = times, time.time() - start
        data["settings"] = {
            "sequence_length": SEQ_LEN,
            "kmeans_iterations": KMEANS_ITERS,
            "workers": args.workers,
            "finetune": asdict(FinetuneConfig()),
        }
        data["commit"] = short_commit()
        STUDY.write_text(json.dumps(data, indent=1, default=float))
    write_page(PAGE)
    draw(json.loads(STUDY.read_text()), FIGS)
    print(f"written from {STUDY.relative_to(ROOT)}: {PAGE.relative_to(ROOT)} and {FIGS.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
