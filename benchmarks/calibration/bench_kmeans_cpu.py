"""CPU k-means on the reference model's real problems: k-means++ seeding and Lloyd updates of one layout of a
capture, with the torch backend's nearest-centroid search through faiss (when installed) and chunked
``baddbmm``, and the faiss backend. Prints wall and CPU seconds and the objectives per variant.

    loopvq-calibrate --config configs/tiny-ouro.yaml --stages capture --set capture.store=disk
    python benchmarks/calibration/bench_kmeans_cpu.py runs/tiny-ouro-loopvq-0.5/capture --problems 16 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.kmeans import solvers as kmeans_backends
from loopvq_calib.calibration.kmeans.fit import layout_problems, layout_seed
from loopvq_calib.calibration.kmeans.seeding import kmeans_pp_init
from loopvq_calib.calibration.kmeans.solvers import weighted_kmeans
from loopvq_calib.calibration.preflight import model_shape
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import KMeansConfig
from loopvq_calib.models.loading import read_model_config, resolve_model_dir


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capture", help="a capture folder written with capture.store: disk")
    ap.add_argument("--config", default="configs/tiny-ouro.yaml")
    ap.add_argument("--layout", type=int, default=0, help="index into the method's layouts")
    ap.add_argument("--problems", type=int, default=0, help="first N problems of the layout (0: all)")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch and faiss threads (0: their defaults)")
    args = ap.parse_args()
    if args.threads:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    cfg = load_config(args.config)
    kv = model_shape(read_model_config(resolve_model_dir(cfg.model.name_or_path, None)), None, "float32")[0]
    layout = plan_layouts(kv, cfg.quant)[args.layout]
    reader = CaptureReader(args.capture)
    x, fisher = reader.load(layout.kind, layout.sites), reader.load("fisher_" + layout.kind, layout.sites)
    points, weights = layout_problems(
        x, fisher, layout, transform=None, codebook_size=cfg.quant.codebook_size, sharing=cfg.quant.codebook_sharing
    )
    p = args.problems or points.shape[0]
    points, weights = points[:p].contiguous(), weights[:p].contiguous()
    print(
        f"{layout.key}: {p} problems x {points.shape[1]} points x G {points.shape[2]}, K {cfg.quant.codebook_size}, "
        f"{torch.get_num_threads()} threads"
    )
    t = clock()
    gen = torch.Generator().manual_seed(layout_seed(0, layout))
    init = kmeans_pp_init(points, weights, cfg.quant.codebook_size, generator=gen)
    e = clock()
    print(f"kmeans++ seeding: wall {e[0] - t[0]:.2f} s, cpu {e[1] - t[1]:.2f} s")
    kc = KMeansConfig(iterations=args.iterations, tolerance=0.0)
    search = kmeans_backends._faiss_search
    variants = [
        ("torch, faiss search", "torch", True),
        ("torch, baddbmm search", "torch", False),
        ("faiss backend", "faiss", True),
    ]
    for name, backend, use_faiss_search in variants:
        kmeans_backends._faiss_search = search if use_faiss_search else (lambda: None)
        t = clock()
        res = weighted_kmeans(points, weights, init, cfg=kc, backend=backend, device="cpu", seed=1)
        e = clock()
        print(
            f"{name}: {args.iterations} updates, wall {e[0] - t[0]:.2f} s, cpu {e[1] - t[1]:.2f} s, "
            f"objective {res.objective_init.mean():.5f} -> {res.objective_final.mean():.5f}"
        )
    kmeans_backends._faiss_search = search


if __name__ == "__main__":
    main()
