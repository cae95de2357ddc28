"""What the shipped fine-tuning recipe buys on unseen text, per reference model,
measured the way a user would, through the command-line tools.

For each model (``--model``, benchmarks/quality/reference_models.py) and cell (loopvq / tasq+loopvq at 0.5 / 0.25
bit): ``loopvq-calibrate`` on the model's config set to the reference setup (every calibration window, 16 of them for
selection, k-means 100 Lloyd updates, 6 epochs with 4 selection points per epoch, fp32: ``reference_overrides``) with
fine-tuning on, ``loopvq-calibrate`` again in the same run directory with ``--set finetune.enabled=false`` (capture,
TaSQ and k-means are reused, so both bundles hold the same run's k-means codebooks, the second unchanged), then
``loopvq-eval`` on the two bundles side by side (the same 8 windows of 512 tokens of the model's evaluation text).
Writes benchmarks/results/finetune-gain-<model>.json, cell by cell (``--resume`` runs only the cells a stored file
lacks); ``--report`` prints each model's table.

Time on one GPU (``--device cuda``): the Ouro reference's four cells (188 windows, ``--jobs 4``) took 187 s on an
H200; a model with fewer windows takes about that in proportion (the Huginn reference's 134: about 2.5 min). Three
models (``--jobs 8``: two models' cells side by side, then the third's) should take about 6-8 min (not measured).
A cell holds up to about 11 GiB of the card at 188 windows (capture 4.7 GiB, then teacher outputs 6.3 GiB; both
sized to what is free, the rest in host memory): ``--jobs 12`` only on an H200. On the CPU (2 idle cores, 2 s per
step at 512 tokens) a model takes about 3 h, far more on shared cores: GPU only.

    python benchmarks/quality/measure_finetune_gain.py --model ouro huginn ouro-python --device cuda --jobs 8
    python benchmarks/quality/measure_finetune_gain.py --model huginn --device cpu --out-dir /tmp/g --cell 2 \\
        --set data.num_sequences=8 --set data.heldout_sequences=2 --set data.sequence_length=64 \\
        --set finetune.epochs=1 --set finetune.select_every=2 --set kmeans.iterations=2 \\
        --eval-args "--num-sequences 1 --sequence-length 64"  # a CPU check, about 3 min
    python benchmarks/quality/measure_finetune_gain.py --report
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import yaml

from benchmarks.common.paths import ROOT
from benchmarks.common.provenance import device_name, git_commit
from benchmarks.quality.finetune_grids import CELLS
from benchmarks.quality.reference_models import MODELS, SHIPPED_MODELS, calibration_windows, reference_overrides

# the console scripts' entry points, run with this interpreter (``loopvq-calibrate`` / ``loopvq-eval``)
ENTRY = {"loopvq-calibrate": "calibrate_main", "loopvq-eval": "eval_main"}


def tool(name: str, args: list[str], log: Path) -> float:
    """Run a console script's entry point with ``args``; its output goes to ``log``; returns its wall time.
    Raises with the log's tail when it fails."""
    code = f"import sys; from loopvq_calib.cli import {ENTRY[name]}; sys.exit({ENTRY[name]}())"
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join([name, *args]) + "\n")
        f.flush()
        done = subprocess.run(
            [sys.executable, "-c", code, *args], check=False, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}; the end of {log}:\n" + log.read_text()[-3000:])
    return wall


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Wall seconds per stage this run directory's last runs computed (reused stages left out)."""
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    return {name: s["wall_s"] for name, s in stages.items() if not s.get("reused") and s.get("wall_s") is not None}


def cell_overrides(model: str, method: str, bits: float, *, device: str, overrides: list[str]) -> list[str]:
    """``--set`` arguments of one cell: the model's folder and calibration text, the cell's quant keys, the device,
    then ``overrides`` (the reference setup and any extra ones; later ones win)."""
    ref = MODELS[model]
    keys = [
        f"model.name_or_path={ref.folder}",
        f"data.dataset={ref.calibration}",
        f"model.device={device}",
        *(f"quant.{k}={v:g}" if isinstance(v, float) else f"quant.{k}={v}" for k, v in ref.quant(method, bits).items()),
        *overrides,
    ]
    return [a for kv in keys for a in ("--set", kv)]


def measure_cell(
    model: str, method: str, bits: float, *, device: str, runs: Path, overrides: list[str], eval_args: list[str]
) -> dict:
    """Both calibrations of one cell and the evaluation of their bundles; returns the cell's record."""
    name = f"{method.replace('+', '-')}-{bits:g}bit"
    cell_dir = runs / model / name
    shutil.rmtree(cell_dir, ignore_errors=True)
    cell_dir.mkdir(parents=True)
    run_dir = cell_dir / "run"
    common = [
        "--config",
        MODELS[model].config,
        "--output",
        str(run_dir),
        *cell_overrides(model, method, bits, device=device, overrides=overrides),
    ]
    out: dict = {"method": method, "bits": bits, "commands": [], "seconds": {}}
    bundles = {}
    for label, flags in (("finetuned", []), ("kmeans", ["--set", "finetune.enabled=false"])):
        args = [*common, *flags, "--set", f"output.bundle_name={name}-{label}"]
        out["commands"].append("loopvq-calibrate " + " ".join(args))
        out["seconds"][f"calibrate_{label}"] = tool("loopvq-calibrate", args, cell_dir / f"calibrate-{label}.log")
        out["seconds"][f"stages_{label}"] = stage_seconds(run_dir)
        bundles[label] = cell_dir / f"bundle-{label}"
        shutil.copytree(run_dir / "bundle", bundles[label])
        if label == "finetuned":  # the curve of the selection points and the setup (the second run replaces both)
            out["finetune_curve"] = json.loads((run_dir / "finetune" / "curve.json").read_text())
            cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
            out["setup"] = {
                "sequences": cfg["data"]["num_sequences"],
                "selection": cfg["data"]["heldout_sequences"],
                "sequence_length": cfg["data"]["sequence_length"],
                "finetune": cfg["finetune"],
            }
        print(f"{model} {name}: calibrate ({label}) {out['seconds'][f'calibrate_{label}']:.1f} s", flush=True)
    args = [
        "--bundle",
        str(bundles["finetuned"]),
        "--bundle",
        str(bundles["kmeans"]),
        "--data",
        MODELS[model].heldout,
        "--device",
        device,
        "--out",
        str(cell_dir / "eval"),
        *eval_args,
    ]
    out["commands"].append("loopvq-eval " + " ".join(args))
    out["seconds"]["eval"] = tool("loopvq-eval", args, cell_dir / "eval.log")
    report = json.loads((cell_dir / "eval" / "report.json").read_text())
    for label, r in zip(("finetuned", "kmeans"), report["bundles"]):
        out[label] = {
            k: r.get(k)
            for k in ("name", "eval_kl", "ppl_fp", "ppl_quantized", "selection_kl", "sequences", "kl_positions")
        }
    out["eval_data"] = report.get("data")
    out["change"] = out["finetuned"]["eval_kl"] / out["kmeans"]["eval_kl"] - 1
    print(
        f"{model} {name}: evaluation KL {out['kmeans']['eval_kl']:.5f} -> {out['finetuned']['eval_kl']:.5f} "
        f"({out['change']:+.1%})",
        flush=True,
    )
    return out


def report(path: Path) -> str:
    """The markdown table of a measurement file."""
    data = json.loads(path.read_text())
    lines = [
        (
            "| cell | k-means (`finetune.enabled=false`) | fine-tuned | change | selection KL k-means -> kept | "
            "kept step | perplexity k-means -> fine-tuned (fp) | fine-tuning stage s | capture + k-means s |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in data["cells"]:
        curve = c["finetune_curve"]
        best = curve["best_step"]
        sel0 = curve["curve"][0]["selection_kl"]
        stages = c["seconds"]["stages_finetuned"]
        fit = sum(stages.get(s, 0.0) for s in ("capture", "tasq", "kmeans"))
        lines.append(
            f"| {c['method']} {c['bits']:g} bit | {c['kmeans']['eval_kl']:.5f} | {c['finetuned']['eval_kl']:.5f} | "
            f"**{c['change']:+.1%}** | {_num(sel0)} -> {_num(c['finetuned']['selection_kl'])} | {best} | "
            f"{c['kmeans']['ppl_quantized']:.2f} -> {c['finetuned']['ppl_quantized']:.2f} "
            f"({c['kmeans']['ppl_fp']:.2f}) | "
            f"{stages.get('finetune', float('nan')):.1f} | {fit:.1f} |"
        )
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.5f}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", choices=list(MODELS), default=list(SHIPPED_MODELS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks/results"))
    p.add_argument("--device", default="auto")
    p.add_argument("--runs", default=str(ROOT / "runs/finetune-gain"))
    p.add_argument("--jobs", type=int, default=1, help="cells calibrated side by side (one GPU holds several)")
    p.add_argument("--cell", type=int, action="append", help="only these cells (0-3), default all four")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="after the reference setup, to both loopvq-calibrate runs of every cell (a CPU check)",
    )
    p.add_argument("--eval-args", default="", help="extra loopvq-eval arguments, e.g. '--num-sequences 2'")
    p.add_argument("--resume", action="store_true", help="keep the stored files' cells, run the others")
    p.add_argument("--report", action="store_true", help="print the tables of the stored files of --model")
    args = p.parse_args()
    args.runs = str(Path(args.runs).resolve())  # the tools run in the checkout
    return args


def start(model: str, args: argparse.Namespace) -> dict:
    """The record of ``model`` at the start: the stored file's (``--resume``: its cells kept, this command added
    under ``resumed``) or a new one of the reference setup on the model's calibration windows."""
    path = Path(args.out_dir) / f"finetune-gain-{model}.json"
    command = "python benchmarks/quality/measure_finetune_gain.py " + shlex.join(sys.argv[1:])
    if args.resume and path.is_file():
        data = json.loads(path.read_text())
        data.setdefault("resumed", []).append({"command": command, "commit": git_commit()})
        return data
    windows = calibration_windows(MODELS[model])
    return {
        "command": command,
        "commit": git_commit(),
        "model": model,
        "config": MODELS[model].config,
        "windows": windows,
        "overrides": [*reference_overrides(windows), *args.overrides],
        "cells": [],
    }


def main() -> None:
    args = parse_args()
    out_dir = Path(args.out_dir)
    if args.report:
        for model in args.model:
            path = out_dir / f"finetune-gain-{model}.json"
            print(f"{model}:\n" + (report(path) if path.is_file() else "not measured") + "\n")
        return
    t0, results = time.perf_counter(), {m: start(m, args) for m in args.model}
    stored = {(m, c["method"], c["bits"]) for m, data in results.items() for c in data["cells"]}
    jobs = [
        (m, c)
        for m in args.model
        for c in ([CELLS[i] for i in args.cell] if args.cell else CELLS)
        if (m, *c) not in stored
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(
                measure_cell,
                m,
                meth,
                bits,
                device=args.device,
                runs=Path(args.runs),
                overrides=results[m]["overrides"],
                eval_args=args.eval_args.split(),
            ): (m, (meth, bits))
            for m, (meth, bits) in jobs
        }
        for fut in as_completed(futures):  # each model's file is rewritten as each of its cells ends, in cell order
            model, key = futures[fut]
            if fut.exception() is not None:  # the other cells go on
                failures.append(f"{model} {key}: {fut.exception()}")
                continue
            data, cell = results[model], fut.result()
            cells = {(c["method"], c["bits"]): c for c in data["cells"]} | {key: cell}
            data["cells"] = [cells[k] for k in CELLS if k in cells]
            data.update(
                sequences=cell["setup"]["sequences"], device=device_name(args.device), total_s=time.perf_counter() - t0
            )
            (out_dir / f"finetune-gain-{model}.json").write_text(json.dumps(data, indent=1))
    for model in args.model:
        if (out_dir / f"finetune-gain-{model}.json").is_file():
            print(f"{model}:\n" + report(out_dir / f"finetune-gain-{model}.json"))
    if failures:
        sys.exit("\n".join(failures))


if __name__ == "__main__":
    main()
