"""The k-means stage alone (``fit_codebooks``, every layout of the method) on a
capture written with ``capture.store: disk``: wall and CPU seconds (user + sys of the whole process, all threads) of
the stage and of its k-means++ seeding, and the mean objectives. Run it with another checkout on PYTHONPATH to
compare code.

    loopvq-calibrate --config configs/tiny-ouro.yaml --stages capture --set capture.store=disk --output /tmp/run
    python benchmarks/calibration/bench_kmeans_stage.py /tmp/run/capture --set kmeans.iterations=20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

import loopvq_calib
from benchmarks.common.provenance import short_commit
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.kmeans.fit import fit_codebooks
from loopvq_calib.calibration.preflight import model_shape
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.config.load import load_config
from loopvq_calib.models.loading import read_model_config, resolve_model_dir


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture", help="a capture folder written with capture.store: disk")
    ap.add_argument("--config", default="configs/tiny-ouro.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    kv = model_shape(read_model_config(resolve_model_dir(cfg.model.name_or_path, None)), None, "float32")[0]
    layouts = plan_layouts(kv, cfg.quant)
    reader = CaptureReader(args.capture)
    wall, cpu = time.perf_counter(), _cpu_s()
    _, report = fit_codebooks(reader, layouts, {}, quant=cfg.quant, cfg=cfg.kmeans, kv=kv, device=torch.device("cpu"))
    totals = report["totals"]
    checkout = Path(loopvq_calib.__file__).resolve().parent  # the code measured (PYTHONPATH may name another tree)
    print(
        json.dumps(
            {
                "code": short_commit(checkout) or "",
                "overrides": args.overrides,
                "threads": torch.get_num_threads(),
                "wall_s": round(time.perf_counter() - wall, 2),
                "cpu_s": round(_cpu_s() - cpu, 2),
                "seeding_wall_s": round(totals["seconds_init"], 2),
                "layouts": totals["layouts"],
                "codebooks": totals["codebooks"],
                "objective_init_mean": round(totals["objective_init_mean"], 6),
                "objective_final_mean": round(totals["objective_final_mean"], 6),
                "load_average": [round(v, 2) for v in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
