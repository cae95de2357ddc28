"""benchmarks/measure_finetune_gain.py: what fine-tuning buys on unseen text, measured the way a user would, through
the command-line tools.

For each cell (loopvq / tasq+loopvq at 0.5 / 0.25 bit) of one config: ``loopvq-calibrate`` with
fine-tuning on, ``loopvq-calibrate`` again in the same run directory with ``--set finetune.enabled=false``
(capture, TaSQ and k-means are reused, so both bundles hold the same run's k-means codebooks, the second
unchanged), then ``loopvq-eval`` on the two bundles side by side (same windows of the evaluation text, the
shipped held-out plays by default). Writes one JSON file; ``--report`` prints its markdown table.

    python benchmarks/measure_finetune_gain.py --config configs/tiny-ouro-reference.yaml --device cuda --jobs 4 \\
        --out benchmarks/results/finetune-gain.json
    python benchmarks/measure_finetune_gain.py --report benchmarks/results/finetune-gain.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CELLS = [("loopvq", 0.5), ("loopvq", 0.25), ("tasq+loopvq", 0.5), ("tasq+loopvq", 0.25)]
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
        done = subprocess.run([sys.executable, "-c", code, *args], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}; the end of {log}:\n" + log.read_text()[-3000:])
    return wall


def stage_seconds(run_dir: Path) -> dict[str, float]:
    """Wall seconds per stage this run directory's last runs computed (reused stages left out)."""
    stages = json.loads((run_dir / "manifest.json").read_text())["stages"]
    return {name: s["wall_s"] for name, s in stages.items() if not s.get("reused") and s.get("wall_s") is not None}


def measure_cell(config: Path, method: str, bits: float, *, device: str, runs: Path, extra: list[str],
                 eval_args: list[str]) -> dict:
    """Both calibrations of one cell and the evaluation of their bundles; returns the cell's record."""
    name = f"{method.replace('+', '-')}-{bits:g}bit"
    cell_dir = runs / name
    shutil.rmtree(cell_dir, ignore_errors=True)
    cell_dir.mkdir(parents=True)
    run_dir = cell_dir / "run"
    common = ["--config", str(config), "--output", str(run_dir), "--set", f"quant.method={method}",
              "--set", f"quant.bits={bits:g}", "--set", f"quant.group_size={round(8 / bits)}",
              "--set", f"model.device={device}", *[a for kv in extra for a in ("--set", kv)]]
    out: dict = {"method": method, "bits": bits, "commands": [], "seconds": {}}
    bundles = {}
    for label, flags in (("finetuned", []), ("kmeans", ["--set", "finetune.enabled=false"])):
        args = [*common, *flags, "--set", f"output.bundle_name={name}-{label}"]
        out["commands"].append("loopvq-calibrate " + " ".join(args))
        out["seconds"][f"calibrate_{label}"] = tool("loopvq-calibrate", args, cell_dir / f"calibrate-{label}.log")
        out["seconds"][f"stages_{label}"] = stage_seconds(run_dir)
        bundles[label] = cell_dir / f"bundle-{label}"
        shutil.copytree(run_dir / "bundle", bundles[label])
        if label == "finetuned":  # the curve of the selection points (the second run replaces the stage)
            out["finetune_curve"] = json.loads((run_dir / "finetune" / "curve.json").read_text())
        print(f"{name}: calibrate ({label}) {out['seconds'][f'calibrate_{label}']:.1f} s", flush=True)
    args = ["--bundle", str(bundles["finetuned"]), "--bundle", str(bundles["kmeans"]), "--device", device,
            "--out", str(cell_dir / "eval"), *eval_args]
    out["commands"].append("loopvq-eval " + " ".join(args))
    out["seconds"]["eval"] = tool("loopvq-eval", args, cell_dir / "eval.log")
    report = json.loads((cell_dir / "eval" / "report.json").read_text())
    for label, r in zip(("finetuned", "kmeans"), report["bundles"]):
        out[label] = {k: r.get(k) for k in ("name", "eval_kl", "ppl_fp", "ppl_quantized", "selection_kl",
                                            "sequences", "kl_positions")}
    out["eval_data"] = report.get("data")
    out["change"] = out["finetuned"]["eval_kl"] / out["kmeans"]["eval_kl"] - 1
    print(f"{name}: evaluation KL {out['kmeans']['eval_kl']:.5f} -> {out['finetuned']['eval_kl']:.5f} "
          f"({out['change']:+.1%})", flush=True)
    return out


def report(path: Path) -> str:
    """The markdown table of a measurement file."""
    data = json.loads(path.read_text())
    lines = ["| cell | k-means (`finetune.enabled=false`) | fine-tuned | change | selection KL k-means -> kept | "
             "kept step | perplexity k-means -> fine-tuned (fp) | fine-tuning stage s | capture + k-means s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        curve = c["finetune_curve"]
        best = curve["best_step"]
        sel0 = curve["curve"][0]["selection_kl"]
        stages = c["seconds"]["stages_finetuned"]
        fit = sum(stages.get(s, 0.0) for s in ("capture", "tasq", "kmeans"))
        lines.append(
            f"| {c['method']} {c['bits']:g} bit | {c['kmeans']['eval_kl']:.5f} | {c['finetuned']['eval_kl']:.5f} | "
            f"**{c['change']:+.1%}** | {_num(sel0)} -> {_num(c['finetuned']['selection_kl'])} | {best} | "
            f"{c['kmeans']['ppl_quantized']:.2f} -> {c['finetuned']['ppl_quantized']:.2f} ({c['kmeans']['ppl_fp']:.2f}) | "
            f"{stages.get('finetune', float('nan')):.1f} | {fit:.1f} |")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.5f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/tiny-ouro-reference.yaml"))
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/finetune-gain.json"))
    p.add_argument("--device", default="auto")
    p.add_argument("--runs", default=str(ROOT / "runs/finetune-gain"))
    p.add_argument("--jobs", type=int, default=1, help="cells calibrated side by side (one GPU holds several)")
    p.add_argument("--cell", type=int, action="append", help="only these cells (0-3), default all four")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="passed to both loopvq-calibrate runs of every cell (a CPU check at a toy size)")
    p.add_argument("--eval-args", default="", help="extra loopvq-eval arguments, e.g. '--num-sequences 2'")
    p.add_argument("--report", help="print the table of this measurement file instead of running")
    args = p.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    cells = [CELLS[i] for i in args.cell] if args.cell else CELLS
    commit = os.environ.get("STUDY_COMMIT") or subprocess.run(  # STUDY_COMMIT: a copy without its own .git
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    config = Path(args.config).resolve()
    results = {"command": "python benchmarks/measure_finetune_gain.py " + " ".join(sys.argv[1:]),
               "commit": commit or None, "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT)
               else str(config), "overrides": args.overrides, "cells": []}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(measure_cell, config, m, b, device=args.device, runs=Path(args.runs),
                               extra=args.overrides, eval_args=args.eval_args.split()): n
                   for n, (m, b) in enumerate(cells)}
        done: dict[int, dict] = {}
        for fut in as_completed(futures):  # each cell is saved as soon as it is done, in the order of CELLS
            done[futures[fut]] = fut.result()
            results["cells"] = [done[n] for n in sorted(done)]
            results["total_s"] = time.perf_counter() - t0
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    results["device"] = (torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu"
                         else "cpu")
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(report(Path(args.out)))


if __name__ == "__main__":
    main()
