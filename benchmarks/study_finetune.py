"""benchmarks/study_finetune.py: what makes fine-tuned codebooks keep their gain on unseen text, a study on the
reference model.

For each (method, width, calibration sequences) one capture and one k-means (normal pipeline run
directories under runs/study-finetune/), then every fine-tuning variant from those k-means codebooks.
Each variant's selection points are also scored on the evaluation text (the shipped held-out plays,
never used for calibration or selection) through ``evaluate_quantizers``, the code ``loopvq-eval``
runs, with loopvq-eval's defaults (8 windows of 512 tokens, every position after the sinks quantized).
The evaluation KL of the selected codebooks is what the tables report; the per-point curve is for the
figure only (it plays no part in any choice). Writes one JSON file.

    python benchmarks/study_finetune.py --device cuda --out benchmarks/results/finetune-study.json
    python benchmarks/study_finetune.py --grid smoke --device cpu --out /tmp/smoke.json   # two variants, one cell
    python benchmarks/study_finetune.py --report benchmarks/results/finetune-study.json  # tables (stdout) + docs/figures PNG
    # batch 1 against batch 2 (docs/finetune.md, "Batch 2"), one process per cell on one GPU, then merged as below:
    python benchmarks/study_finetune.py --device cuda --grid batch2 --cell 0 --out b0.json   # ... cells 1-3
    # the data grid (64 and 176 calibration sequences), one process per cell on one GPU, then merged:
    python benchmarks/study_finetune.py --device cuda --grid data --cell 0 --out cell0.json   # ... cells 1-3
    python benchmarks/study_finetune.py --merge cell0.json cell1.json cell2.json cell3.json --out benchmarks/results/finetune-study-data.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from loopvq_calib.calibration.finetune.train import finetune_codebooks
from loopvq_calib.calibration.pipeline import Pipeline, calibrate
from loopvq_calib.calibration.stages import load_quantizer
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import DataConfig, FinetuneConfig
from loopvq_calib.data.corpus import build_calibration_set
from loopvq_calib.evaluation.evaluate import evaluate_quantizers
from loopvq_calib.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "artifacts/data/shakespeare-heldout.jsonl"  # loopvq-eval's default evaluation text
CELLS = [("loopvq", 0.5), ("loopvq", 0.25), ("tasq+loopvq", 0.5), ("tasq+loopvq", 0.25)]
GROUP = {0.5: 16, 0.25: 32}
PAPER = {"epochs": 4, "lr": 1e-3}  # the paper's recipe (and the shipped one before this study)

VARIANTS = {
    "paper": {},
    "lr3e-3": {"lr": 3e-3},
    "lr1e-2": {"lr": 1e-2},
    "lr1e-2-cosine-every4": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4},
    "lr3e-2-cosine-every4": {"lr": 3e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4},
    "proximal1": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4, "proximal": 1.0},
    "proximal10": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4, "proximal": 10.0},
    "proximal100": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4, "proximal": 100.0},
    "min-usage32": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4, "min_usage": 32},
    "affine-lr3e-3": {"lr": 3e-3, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4,
                      "parameterization": "affine"},
    "affine-lr1e-2": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4,
                      "parameterization": "affine"},
    "affine-lr3e-2": {"lr": 3e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 4,
                      "parameterization": "affine"},
    "batch4-lr1e-2": {"lr": 1e-2, "batch_size": 4, "epochs": 12, "lr_schedule": "cosine", "select_every": 3},
    # the data grid (more calibration sequences); selection every ~1/6 epoch
    "proximal1-every8": {"lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 8, "proximal": 1.0},
    "batch4-every4": {"lr": 1e-2, "batch_size": 4, "epochs": 8, "lr_schedule": "cosine", "warmup_steps": 4,
                      "select_every": 4, "proximal": 1.0},
    "batch4-every6": {"lr": 1e-2, "batch_size": 4, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 6,
                      "proximal": 1.0},
    "lr3e-3-every22": {"lr": 3e-3, "lr_schedule": "cosine", "warmup_steps": 4, "select_every": 22, "proximal": 1.0},
    # proximal1 with 2 sequences per step (one per process on 2 GPUs): warm-up and selection at the same sequences
    "proximal1-batch2": {"lr": 1e-2, "batch_size": 2, "lr_schedule": "cosine", "warmup_steps": 2, "select_every": 2,
                         "proximal": 1.0},
    "proximal1-batch2-lr1.4e-2": {"lr": 1.4e-2, "batch_size": 2, "lr_schedule": "cosine", "warmup_steps": 2,
                                  "select_every": 2, "proximal": 1.0},
    "proximal1-batch2-lr2e-2": {"lr": 2e-2, "batch_size": 2, "lr_schedule": "cosine", "warmup_steps": 2,
                                "select_every": 2, "proximal": 1.0},
    "proximal1-batch2-epochs6": {"lr": 1e-2, "batch_size": 2, "epochs": 6, "lr_schedule": "cosine", "warmup_steps": 2,
                                 "select_every": 2, "proximal": 1.0},
}
SEQUENCES = {16: ["paper", "lr1e-2-cosine-every4", "proximal1", "min-usage32", "affine-lr1e-2", "affine-lr3e-2",
                  "batch4-lr1e-2"],
             64: ["proximal1", "affine-lr1e-2"]}
DATA = {64: ["proximal1-every8", "batch4-every4"],  # 48 train / 16 selection sequences
        176: ["batch4-every6", "lr3e-3-every22"]}  # 132 / 44 (188 windows in the corpus); the shipped recipe
# at 176 sequences (proximal1-every22) is configs/tiny-ouro-reference.yaml, measured by measure_finetune_gain.py
BATCH2 = {16: ["proximal1", "proximal1-batch2", "proximal1-batch2-lr1.4e-2", "proximal1-batch2-lr2e-2",
              "proximal1-batch2-epochs6"]}  # the shipped 16-sequence recipe at batch 1 and batch 2 variants
SMOKE = {"cells": CELLS[2:3], "sequences": {8: ["paper", "affine-lr3e-2"]}}
SMOKE_SHAPES = {"sequence_length": 64, "kmeans_iterations": 3, "epochs": 1, "eval": (2, 64)}  # a quick CPU check


def run_config(method: str, bits: float, sequences: int, *, device: str, run_dir: Path, smoke: bool = False) -> dict:
    cfg = yaml.safe_load((ROOT / "configs/tiny-ouro.yaml").read_text())
    cfg["model"].update(name_or_path=str(ROOT / "artifacts/tiny-ouro"), device=device)
    cfg["data"].update(dataset=str(ROOT / "artifacts/data/shakespeare-calib.jsonl"), num_sequences=sequences,
                       heldout_sequences=sequences // 4)
    cfg["quant"].update(method=method, bits=bits, group_size=GROUP[bits], codebook_size=256)
    cfg["capture"] = {"store": "disk"}
    cfg["kmeans"].update(backend="torch", iterations=100, tolerance=1e-5,  # same backend on CPU and GPU; the study's 100 updates
                         problems_per_batch=96)  # smaller batches: one GPU runs four cells side by side
    # (the shipped demo config shortens k-means and fine-tuning to fit its one-minute budget)
    cfg["output"]["dir"] = str(run_dir)
    if smoke:
        cfg["data"]["sequence_length"] = SMOKE_SHAPES["sequence_length"]
        cfg["kmeans"]["iterations"] = SMOKE_SHAPES["kmeans_iterations"]
    return cfg


def study_cell(method: str, bits: float, sequences: int, *, variants: list[str], device: str, runs: Path,
               smoke: bool = False, partial: Callable[[dict], Any] | None = None) -> dict:
    """One capture and k-means, then every variant from those codebooks; ``partial(cell)`` sees the cell's
    record after each variant (a time limit still leaves the finished ones)."""
    run_dir = runs / f"{method.replace('+', '-')}-{bits}-n{sequences}"
    raw = run_config(method, bits, sequences, device=device, run_dir=run_dir, smoke=smoke)
    t0 = time.perf_counter()
    calibrate(raw, stages=["kmeans"])
    calibrate_s = time.perf_counter() - t0
    cfg = load_config(raw)
    calib = Pipeline(cfg).stage_data()
    init = load_quantizer(run_dir / "kmeans")
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_model(ROOT / "artifacts/tiny-ouro", "float32", dev)
    windows, length = SMOKE_SHAPES["eval"] if smoke else (8, 512)
    eval_ids = build_calibration_set(DataConfig(dataset=str(HELDOUT), num_sequences=windows, sequence_length=length,
                                                heldout_sequences=0), tokenizer).input_ids
    sink = cfg.data.sink_tokens

    def evaluation_kl(q) -> float:
        return evaluate_quantizers(model, eval_ids, [(q, sink)], per_step=False)[0]["eval_kl"]

    kmeans_kl = evaluation_kl(init.to(dev))
    out = {"method": method, "bits": bits, "sequences": sequences, "train": len(calib.train),
           "selection": len(calib.heldout), "capture_kmeans_s": calibrate_s, "kmeans_evaluation_kl": kmeans_kl,
           "variants": {}}
    for name in variants:
        settings = {**PAPER, **VARIANTS[name], "autocast": "none", "cache_teacher": "true"}
        if smoke:
            settings["epochs"] = SMOKE_SHAPES["epochs"]
        points, eval_s = [], 0.0

        def on_select(entry, q):
            nonlocal eval_s
            t = time.perf_counter()
            points.append({**entry, "evaluation_kl": evaluation_kl(q)})
            eval_s += time.perf_counter() - t

        t0 = time.perf_counter()
        result = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(**settings), device=dev, on_select=on_select)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0 - eval_s
        chosen = next(p for p in points if p["step"] == result.best_step)
        out["variants"][name] = {
            "settings": VARIANTS[name], "best_step": result.best_step, "best_epoch": result.best_epoch,
            "selection_kl": chosen["selection_kl"], "evaluation_kl": chosen["evaluation_kl"],
            "reduction": 1 - chosen["evaluation_kl"] / kmeans_kl, "finetune_s": wall, "curve": points,
        }
        print(f"{method} {bits} n{sequences} {name}: evaluation KL {kmeans_kl:.5f} -> {chosen['evaluation_kl']:.5f} "
              f"({out['variants'][name]['reduction']:+.1%}), step {result.best_step}, {wall:.1f} s", flush=True)
        if partial is not None:
            partial(out)
    return out


def report(path: Path, figure: Path) -> str:
    """Markdown tables of a study file (evaluation KL per cell and variant, relative change against the same
    run's k-means codebooks, mean over cells) and the figure of evaluation KL against optimizer step."""
    data = json.loads(path.read_text())
    cells = data["cells"]
    names = list(dict.fromkeys(n for c in cells for n in c["variants"]))
    several = len({c["sequences"] for c in cells}) > 1  # the data grid: name the calibration sequences
    head = [f"{c['method']} {c['bits']:g} bit" + (f", {c['sequences']} seq." if several else "")
            + (" *" if c.get("partial") else "") for c in cells]
    lines = ["| variant | " + " | ".join(head) + " | mean change | fine-tuning s (H200, mean) |",
             "|---|" + "---|" * (len(cells) + 2),
             "| k-means (no fine-tuning) | " + " | ".join(f"{c['kmeans_evaluation_kl']:.5f}" for c in cells) + " | | |"]
    for name in names:
        row, changes, secs = [], [], []
        for c in cells:
            v = c["variants"].get(name)
            if v is None:
                row.append("-")
                continue
            changes.append(-v["reduction"])
            secs.append(v["finetune_s"])
            row.append(f"{v['evaluation_kl']:.5f} ({-v['reduction']:+.1%}, step {v['best_step']})")
        mean = f"{sum(changes) / len(changes):+.1%}" + ("" if len(changes) == len(cells) else f" ({len(changes)} cells)")
        lines.append(f"| {name} | " + " | ".join(row) + f" | {mean} | {sum(secs) / len(secs):.1f} |")
    _figure(cells, figure)
    return "\n".join(lines)


FIGURE_VARIANTS = ("paper", "lr1e-2-cosine-every4", "proximal1", "affine-lr1e-2", "batch4-lr1e-2")


def _figure(cells: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [c for c in cells if not c.get("partial") and c["variants"]]
    present = list(dict.fromkeys(n for c in shown for n in c["variants"]))
    names = [n for n in FIGURE_VARIANTS if n in present] or present  # the data grid: every variant it ran
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.4), squeeze=False)
    for ax, c in zip(axes[0], shown):
        for name in names:
            v = c["variants"].get(name)
            if v and v["curve"]:
                steps = [p["step"] * v["settings"].get("batch_size", 1) for p in v["curve"]]
                ax.plot(steps, [p["evaluation_kl"] for p in v["curve"]], marker=".", label=name)
        ax.axhline(c["kmeans_evaluation_kl"], color="grey", lw=0.8, ls="--")
        ax.set_title(f"{c['method']} {c['bits']:g} bit, {c['sequences']} seq.")
        ax.legend(fontsize=6)
        ax.set_xlabel("training sequences seen")
    axes[0][0].set_ylabel("evaluation KL (held-out plays)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def merge(files: list[str], out: str) -> dict[str, Any]:
    """One study file from per-cell ones: their cells in order, the longest part's time, the merge as its
    ``command`` and each part's own command under ``parts``."""
    parts = [json.loads(Path(f).read_text()) for f in files]
    return {**parts[0], "command": f"python benchmarks/study_finetune.py --merge {' '.join(files)} --out {out}",
            "parts": [part["command"] for part in parts], "cells": [c for part in parts for c in part["cells"]],
            "total_s": max(part.get("total_s", 0.0) for part in parts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/finetune-study.json"))
    p.add_argument("--device", default="auto")
    p.add_argument("--grid", choices=["main", "data", "batch2", "smoke", "smoke-data"], default="main")
    p.add_argument("--cell", type=int, action="append",
                   help="only these cells (0-3: loopvq 0.5, loopvq 0.25, tasq+loopvq 0.5, tasq+loopvq 0.25); "
                        "one process per cell runs them side by side on one GPU")
    p.add_argument("--runs", default=str(ROOT / "runs/study-finetune"))
    p.add_argument("--report", help="print the tables of this study file and write the figure instead of running")
    p.add_argument("--merge", nargs="+", help="merge these per-cell study files into --out")
    p.add_argument("--figure", default=str(ROOT / "docs/figures/finetune-study.png"))
    args = p.parse_args()
    if args.report:
        print(report(Path(args.report), Path(args.figure)))
        return
    if args.merge:
        Path(args.out).write_text(json.dumps(merge(args.merge, args.out), indent=1))
        return
    smoke = args.grid.startswith("smoke")
    cells = SMOKE["cells"] if args.grid == "smoke" else CELLS
    if args.cell:
        cells = [cells[i] for i in args.cell]
    sequences = {"main": SEQUENCES, "data": DATA, "batch2": BATCH2, "smoke": SMOKE["sequences"],
                 "smoke-data": {8: DATA[64][:1], 12: DATA[176][:1]}}[args.grid]
    commit = os.environ.get("STUDY_COMMIT") or subprocess.run(  # STUDY_COMMIT: a copy without its own .git
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cell_args = "".join(f" --cell {i}" for i in args.cell or [])
    results = {"command": f"python benchmarks/study_finetune.py --device {args.device} --grid {args.grid}{cell_args}",
               "commit": commit or None, "variants": VARIANTS, "paper": PAPER, "cells": []}
    t0 = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for n, names in sequences.items():
        for method, bits in cells:
            done = list(results["cells"])

            def save(cell: dict) -> None:
                results["cells"] = [*done, cell]
                results["total_s"] = time.perf_counter() - t0
                Path(args.out).write_text(json.dumps(results, indent=1))

            save(study_cell(method, bits, n, variants=names, device=args.device, runs=Path(args.runs), smoke=smoke,
                            partial=save))
    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    results["total_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
