"""Which fine-tuning recipe lowers the evaluation KL on every reference model.

Per model (benchmarks/quality/reference_models.py) and cell (loopvq / tasq+loopvq at 0.5 / 0.25 bit): one capture and
k-means on the model's calibration text (normal run directories under runs/study-finetune/; one more k-means
with codebooks shared across heads for the ``sharing-heads`` variant), then every variant of the grid from those
codebooks in fp32. The codebooks each variant keeps (lowest selection KL) are scored on the model's evaluation
text with ``evaluate_quantizers``, the code and defaults ``loopvq-eval`` runs (8 windows of 512 tokens, every
position after the sinks quantized). A variant's gain is 1 - its evaluation KL / that of the cell's k-means
codebooks (no sharing). Writes benchmarks/results/finetune-study-<model>[-<grid>].json, cell by cell as each
variant ends (a time limit keeps what finished; ``--resume`` runs only the cells not finished).

Grids: ``levers`` (16 calibration sequences, 13 variants: the shipped recipe, once more in another sequence order
(the noise), the paper's recipe, lr, proximal weight, epochs, sequences per step, affine parameterisation,
min_usage, codebook sharing across heads),
``data`` (64 sequences: 4 variants; selection points kept per epoch), ``smoke`` (one cell, toy shapes).

Time on one GPU (``--device cuda``), estimated from the stored H200 study of the Ouro reference (a variant at 16
sequences took 3-4 s with the four cells side by side, one at 64 sequences about 30 s): with ``--jobs 4`` (a
model's four cells side by side) ``levers`` takes about 1.5 min per model (13 variants, two k-means, start-up) and
``data`` about 2.5 min. Steps of this size are launch-bound, so three models side by side (``--jobs 12``, 16 CPU
cores) should take well under three times that: about 3-5 min for ``levers`` (not measured). On the CPU a
fine-tuning step at 512 tokens took 2 s on the Huginn reference with 2 idle cores (12 s while they were shared):
``levers`` takes about 2 h per model there, 1 h for two cells (``--cell 0 --cell 3``), several times that on
shared cores; ``smoke`` 2-10 min.

    python benchmarks/quality/study_finetune.py --model ouro huginn ouro-python --device cuda --jobs 12  # levers
    python benchmarks/quality/study_finetune.py --model ouro huginn ouro-python --device cuda --jobs 12 --grid data
    python benchmarks/quality/study_finetune.py --model huginn --grid smoke --device cpu --out-dir /tmp/s  # a CPU check
    python benchmarks/quality/study_finetune.py --report [--write docs/finetune.md]   # the cross-model tables
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import yaml

from benchmarks.common.paths import ROOT
from benchmarks.common.provenance import device_name, git_commit
from benchmarks.quality.finetune_grids import (
    GRIDS,
    QUANT,
    RECIPE_KEYS,
    SMOKE_SHAPES,
    VARIANTS,
    Grid,
    results_name,
    scaled,
    sharing_of,
)
from benchmarks.quality.finetune_report import page_block, write_block
from benchmarks.quality.reference_models import MODELS, SHIPPED_MODELS


def run_config(model: str, method: str, bits: float, *, grid: Grid, sharing: str, device: str, run_dir: Path) -> dict:
    """The calibration config of one cell: the model's config with its text, the cell's quant keys, k-means 100
    Lloyd updates."""
    ref = MODELS[model]
    cfg = yaml.safe_load((ROOT / ref.config).read_text())
    cfg["model"].update(name_or_path=str(ROOT / ref.folder), device=device)
    cfg["data"].update(
        dataset=str(ROOT / ref.calibration), num_sequences=grid.sequences, heldout_sequences=grid.sequences // 4
    )
    cfg["quant"].update(ref.quant(method, bits), codebook_sharing=sharing)
    cfg["kmeans"].update(iterations=100, tolerance=1e-5, problems_per_batch=96)  # 96: cells share one GPU
    cfg["output"]["dir"] = str(run_dir)
    if grid.smoke:
        cfg["data"]["sequence_length"] = SMOKE_SHAPES["sequence_length"]
        cfg["kmeans"]["iterations"] = SMOKE_SHAPES["kmeans_iterations"]
    return cfg


def fine_tune(
    model: Any,
    calib: Any,
    init: Any,
    *,
    recipe: dict[str, Any],
    smoke: bool,
    device: Any,
    evaluation_kl: Callable[[Any], float],
) -> dict[str, Any]:
    """One variant from ``init``: its kept point, the selection and evaluation KL there, its seconds and curve."""
    import torch

    from loopvq_calib.calibration.finetune.train import finetune_codebooks
    from loopvq_calib.config.schema import FinetuneConfig

    settings = {**recipe, "autocast": "none", "cache_teacher": "true"}
    if smoke:
        settings["epochs"] = SMOKE_SHAPES["epochs"]
    t0 = time.perf_counter()
    result = finetune_codebooks(model, calib, init, cfg=FinetuneConfig(**settings), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kept = next(p for p in result.curve if p["step"] == result.best_step)
    return {
        "settings": {k: settings[k] for k in RECIPE_KEYS},
        "best_step": result.best_step,
        "best_epoch": result.best_epoch,
        "selection_kl_kmeans": result.curve[0]["selection_kl"],
        "selection_kl": kept["selection_kl"],
        "evaluation_kl": evaluation_kl(result.quantizer),
        "finetune_s": wall,
        "curve": result.curve,
    }


def study_cell(
    model: str, method: str, bits: float, *, grid: Grid, device: str, runs: Path, save: Callable[[dict], Any]
) -> dict:
    """The k-means codebooks of one cell (each sharing its variants need), then every variant; ``save(cell)``
    sees the cell's record after each variant."""
    import torch

    from loopvq_calib.calibration.pipeline import calibrate
    from loopvq_calib.calibration.stages import load_calibration, load_quantizer
    from loopvq_calib.config.load import load_config
    from loopvq_calib.config.schema import DataConfig
    from loopvq_calib.data.corpus import build_calibration_set
    from loopvq_calib.evaluation.evaluate import evaluate_quantizers
    from loopvq_calib.models.loading import load_model

    ref = MODELS[model]
    base = runs / model / f"{method.replace('+', '-')}-{bits:g}-n{grid.sequences}"
    t0, inits, raws = time.perf_counter(), {}, {}
    for sharing in dict.fromkeys(["none", *map(sharing_of, grid.variants)]):
        raws[sharing] = run_config(
            model, method, bits, grid=grid, sharing=sharing, device=device, run_dir=base / sharing
        )
        calibrate(raws[sharing], stages=["kmeans"])
        inits[sharing] = load_quantizer(base / sharing / "kmeans")
    calibrate_s = time.perf_counter() - t0
    cfg = load_config(raws["none"])  # the calibration and selection text every variant shares
    calib = load_calibration(base / "none" / "data")
    dev = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    lm, tokenizer = load_model(ROOT / ref.folder, "float32", dev)
    windows, length = SMOKE_SHAPES["eval"] if grid.smoke else (8, 512)
    eval_ids = build_calibration_set(
        DataConfig(dataset=str(ROOT / ref.heldout), num_sequences=windows, sequence_length=length, heldout_sequences=0),
        tokenizer,
    ).input_ids

    def evaluation_kl(q: Any) -> float:
        return evaluate_quantizers(lm, eval_ids, [(q.to(dev), cfg.data.sink_tokens)], per_step=False)[0]["eval_kl"]

    kmeans = {sharing: evaluation_kl(q) for sharing, q in inits.items()}
    out = {
        "method": method,
        "bits": bits,
        "sequences": grid.sequences,
        "train": len(calib.train),
        "selection": len(calib.heldout),
        "calibrate_s": calibrate_s,
        "kmeans_evaluation_kl": kmeans["none"],
        "kmeans_evaluation_kl_by_sharing": kmeans,
        "variants": {},
    }
    for name in grid.variants:
        v = fine_tune(
            lm,
            calib,
            inits[sharing_of(name)],
            recipe=scaled(VARIANTS[name], len(calib.train)),
            smoke=grid.smoke,
            device=dev,
            evaluation_kl=evaluation_kl,
        )
        out["variants"][name] = {**v, "reduction": 1 - v["evaluation_kl"] / kmeans["none"]}
        print(
            f"{model} {method} {bits:g} n{grid.sequences} {name}: evaluation KL {kmeans['none']:.5f} -> "
            f"{v['evaluation_kl']:.5f} ({-out['variants'][name]['reduction']:+.1%}), step {v['best_step']}, "
            f"{v['finetune_s']:.1f} s",
            flush=True,
        )
        save(out)
    return out


def cell_done(cell: dict, grid: Grid) -> bool:
    """Whether a stored cell holds every variant of ``grid``."""
    return set(grid.variants) <= set(cell["variants"])


def save_cell(path: Path, cell: dict, *, grid: Grid, lock: Path) -> None:
    """Put ``cell`` into the study file ``path`` (cells in the grid's order), under ``lock``: the processes of one
    model write their cells into one file."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        data = json.loads(path.read_text())
        key = (cell["method"], cell["bits"])
        cells = {(c["method"], c["bits"]): c for c in data["cells"]} | {key: cell}
        data["cells"] = [cells[k] for k in grid.cells if k in cells]
        data["device"] = device_name(cell.get("device", "cpu"))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)


def start_file(path: Path, header: dict, *, resume: bool) -> dict:
    """The study file at the start of a run: the stored one (``resume``; this run's command and commit added under
    ``resumed``) or a new one of ``header``; returns it."""
    if resume and path.is_file():
        data = json.loads(path.read_text())
        data.setdefault("resumed", []).append({"command": header["command"], "commit": header["commit"]})
    else:
        data = {**header, "cells": []}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return data


def run_cells(args: argparse.Namespace, model: str, grid: Grid, *, cells: list[int]) -> None:
    """The ``cells`` (indices into the grid's) of ``model`` in this process, skipping finished ones."""
    path, lock = Path(args.out_dir) / results_name(model, args.grid), Path(args.runs) / f"{model}-{args.grid}.lock"
    stored = {(c["method"], c["bits"]): c for c in json.loads(path.read_text())["cells"]}
    for i in cells:
        method, bits = grid.cells[i]
        if (method, bits) in stored and cell_done(stored[(method, bits)], grid):
            print(f"{model} {method} {bits:g}: stored, skipped", flush=True)
            continue
        study_cell(
            model,
            method,
            bits,
            grid=grid,
            device=args.device,
            runs=Path(args.runs),
            save=lambda cell: save_cell(path, {**cell, "device": args.device}, grid=grid, lock=lock),
        )


def run_jobs(args: argparse.Namespace, grid: Grid) -> list[str]:
    """One process per (model, cell), ``--jobs`` at a time; returns the failures (their logs are under --runs)."""
    todo = [(m, i) for m in args.model for i in (args.cell or range(len(grid.cells)))]

    def one(job: tuple[str, int]) -> str | None:
        model, i = job
        log = Path(args.runs) / model / f"{args.grid}-cell{i}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            __file__,
            "--model",
            model,
            "--cell",
            str(i),
            "--grid",
            args.grid,
            "--device",
            args.device,
            "--out-dir",
            args.out_dir,
            "--runs",
            args.runs,
            "--child",
        ]
        with log.open("w") as f:
            rc = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        print(f"{model} cell {i}: exit {rc} ({log})", flush=True)
        return None if rc == 0 else f"{model} cell {i} exited {rc}: {log}"

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        return [f for f in pool.map(one, todo) if f]


def merge(files: list[str], out: str) -> dict[str, Any]:
    """One study file from per-cell ones (written by separate calls): their cells in order, the longest part's
    time, the merge as its ``command`` and each part's own command under ``parts``."""
    parts = [json.loads(Path(f).read_text()) for f in files]
    return {
        **parts[0],
        "command": f"python benchmarks/quality/study_finetune.py --merge {' '.join(files)} --out {out}",
        "parts": [part["command"] for part in parts],
        "cells": [c for part in parts for c in part["cells"]],
        "total_s": max(part.get("total_s", 0.0) for part in parts),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=list(MODELS), default=list(SHIPPED_MODELS))
    p.add_argument("--grid", choices=list(GRIDS), default="levers")
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--cell",
        type=int,
        action="append",
        help="only these cells of the grid (0-3: loopvq 0.5, loopvq 0.25, tasq+loopvq 0.5, tasq+loopvq 0.25)",
    )
    p.add_argument("--jobs", type=int, default=0, help="one process per (model, cell), this many at a time")
    p.add_argument("--resume", action="store_true", help="keep the stored file's finished cells, run the others")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a process of --jobs
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--runs", default=str(ROOT / "runs/study-finetune"))
    p.add_argument("--report", action="store_true", help="print the cross-model tables of the stored results")
    p.add_argument("--write", help="with --report: replace the generated block of this page (docs/finetune.md)")
    p.add_argument("--merge", nargs="+", help="merge these per-cell study files into --out")
    p.add_argument("--out", help="with --merge: the merged file")
    args = p.parse_args()
    args.out_dir, args.runs = str(Path(args.out_dir).resolve()), str(Path(args.runs).resolve())  # --jobs: cwd ROOT
    return args


def main() -> None:
    args = parse_args()
    if args.report:
        block = page_block(Path(args.out_dir))
        if args.write:
            write_block(Path(args.write), block)
        print(block)
        return
    if args.merge:
        Path(args.out).write_text(json.dumps(merge(args.merge, args.out), indent=1))
        return
    grid, t0 = GRIDS[args.grid], time.perf_counter()
    cells = args.cell or list(range(len(grid.cells)))
    paths = {m: Path(args.out_dir) / results_name(m, args.grid) for m in args.model}
    if not args.child:  # a --jobs process writes into the file its parent started
        header = {
            "command": "python benchmarks/quality/study_finetune.py " + shlex.join(sys.argv[1:]),
            "commit": git_commit(),
            "grid": args.grid,
            "sequences": grid.sequences,
            "variants": {n: VARIANTS[n] for n in grid.variants},
            "quant": {n: QUANT[n] for n in grid.variants if n in QUANT},
        }
        for model, path in paths.items():
            start_file(path, {**header, "model": model}, resume=args.resume)
    failures = run_jobs(args, grid) if args.jobs else []
    for model in [] if args.jobs else args.model:
        run_cells(args, model, grid, cells=cells)
    if not (args.child or args.cell):  # the whole grid's time
        for path in paths.values():
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "total_s": time.perf_counter() - t0}, indent=1))
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
