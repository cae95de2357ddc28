"""Time the real calibration, ``loopvq_calib.calibrate()`` on a config (+ ``--set`` overrides), the same wiring as
``loopvq-calibrate``, then one JSON line with the whole call's wall time and each stage's wall time and peak GPU
memory as the run's manifest records them; `benchmarks/calibration/measure_real_command.sh` reads its
:func:`summarize` (docs/performance.md has the measured numbers).

    python scripts/make_random_checkpoint.py --model ouro-1.4b --out /tmp/ouro-1.4b-random
    python benchmarks/calibration/bench_pipeline.py --config configs/ouro-1.4b.yaml \
        --set model.name_or_path=/tmp/ouro-1.4b-random --set data.dataset=artifacts/data/shakespeare-calib.jsonl \
        --output /tmp/run
    accelerate launch --num_processes 2 benchmarks/calibration/bench_pipeline.py --config configs/ouro-2.6b.yaml \
        --set ...
    python benchmarks/calibration/bench_pipeline.py --summarize /tmp/run   # a finished run's line, no work

A stage reused from an earlier run in the same output folder is reported as reused (its time is not
measured again): pass a fresh ``--output`` to time every stage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from loopvq_calib import calibrate
from loopvq_calib.calibration.stages import load_finetune, selection_metrics

GIB = 2**30


def summarize(run_dir: Path, wall_s: float | None = None, records: list[dict] | None = None) -> dict[str, Any]:
    """The JSON line of a finished run, from its manifest and stage outputs; ``records`` (``RunResult.stages``)
    are this invocation's stages (a reused stage is marked so), else the manifest's last record of each."""
    run_dir = Path(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cfg = manifest["config"]
    stages = {}
    for rec in records if records is not None else [{"name": k, **v} for k, v in manifest["stages"].items()]:
        peak = rec.get("peak_gpu_bytes")
        stages[rec["name"]] = {
            "wall_s": round(rec.get("wall_s", 0.0), 2),
            "peak_gpu_gib": round(peak / GIB, 2) if peak else None,
            "status": "reused" if rec.get("reused") else rec.get("status"),
        }
    capture = manifest["stages"].get("capture", {}).get("details", {})
    out = {
        "model": cfg["model"]["name_or_path"],
        "method": cfg["quant"]["method"],
        "bits": cfg["quant"]["bits"],
        "sequences": cfg["data"]["num_sequences"],
        "seq_len": cfg["data"]["sequence_length"],
        "processes": manifest.get("processes"),
        "store": capture.get("store"),
        "fisher_channels": cfg["capture"]["fisher_channels"],
        "model_load_s": capture.get("model_load_s"),
        "stages": stages,
        "stages_s": round(sum(s["wall_s"] for s in stages.values()), 2),
        "peak_gpu_gib": max((s["peak_gpu_gib"] or 0 for s in stages.values()), default=0),
    }
    if wall_s is not None:
        out["calibrate_s"] = round(wall_s, 2)
    report = run_dir / "kmeans" / "report.json"
    if report.is_file():
        totals = json.loads(report.read_text())["totals"]
        totals = totals if isinstance(totals, list) else [totals]
        out.update(
            kmeans_backend=totals[0]["backend"],
            kmeans_init_s=round(sum(t["seconds_init"] for t in totals), 2),
            kmeans_iterations_max=max(t["iterations_max"] for t in totals),
            kmeans_probe_s=round(max(t.get("seconds_backend", 0.0) for t in totals), 2),
        )
    tasq = run_dir / "tasq" / "tasq.json"
    if tasq.is_file():  # the TaSQ fit's phases (main process)
        out["tasq_seconds"] = json.loads(tasq.read_text())["report"].get("seconds")
    if (run_dir / "finetune" / "curve.json").is_file():
        out.update(selection_metrics(load_finetune(run_dir / "finetune")))
    out["startup"] = manifest.get("startup")  # seconds of each start-up step before the first stage
    out["warmup"] = manifest.get("warmup")  # background first-use jobs: seconds each ran, seconds a stage waited
    out["store_reason"] = capture.get("store_reason")
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="a loopvq-calibrate config (configs/*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    p.add_argument("--output", type=Path, default=None, help="run directory (default: the config's output.dir)")
    p.add_argument("--stages", default=None, help="as loopvq-calibrate --stages")
    p.add_argument("--summarize", type=Path, default=None, help="only print the JSON line of this finished run")
    args = p.parse_args()
    if args.summarize:
        print(json.dumps(summarize(args.summarize)))
        return
    if args.config is None:
        p.error("--config is required (or --summarize RUN_DIR)")
    stages = [s.strip() for s in args.stages.split(",")] if args.stages else None
    start = time.perf_counter()
    result = calibrate(args.config, args.output, stages, overrides=args.overrides)
    wall = time.perf_counter() - start
    if result.is_main:
        print(json.dumps(summarize(result.run_dir, wall, result.stages)), flush=True)


if __name__ == "__main__":
    main()
