"""k-means backends on the same problems: fused Triton kernels and batched torch (GPU, or CPU) against faiss-cpu, from
the same k-means++ initial centroids and the same number of iterations; k-means++ seeding timed with both the torch
draws and the fused kernels. Problems have Ouro-1.4B's k-means shape (32,768 points of G = 16 or 32 dims, K = 256 per
codebook); data are Gaussian mixtures with Fisher-like log-normal weights. Prints one JSON line per backend.

    python benchmarks/calibration/bench_kmeans.py --problems 512 --iterations 25 --backends triton torch faiss
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from loopvq_calib.calibration.kmeans.seeding import kmeans_pp_init
from loopvq_calib.calibration.kmeans.solvers import weighted_kmeans
from loopvq_calib.config.schema import KMeansConfig
from loopvq_calib.kernels.backends import Backend, available


def problems(
    p: int, n: int, g: int, *, k: int, seed: int = 0, gen: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p`` Gaussian-mixture problems of ``n`` points in ``g`` dims around ``k`` centres, with log-normal
    weights scaled to at most 1; drawn from ``gen`` (on its device) or a CPU generator seeded ``seed``."""
    gen = gen if gen is not None else torch.Generator().manual_seed(seed)
    device = gen.device
    centres = torch.randn(p, k, g, generator=gen, device=device) * 2
    pick = torch.randint(0, k, (p, n), generator=gen, device=device)
    x = centres.gather(1, pick[..., None].expand(-1, -1, g)) + torch.randn(p, n, g, generator=gen, device=device)
    w = torch.exp(torch.randn(p, n, generator=gen, device=device) * 1.5)
    return x, w / w.amax(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--points", type=int, default=32768)
    ap.add_argument("--dims", type=int, default=16)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=25)
    ap.add_argument("--backends", nargs="+", default=["triton", "torch", "faiss"])
    args = ap.parse_args()
    x, w = problems(args.problems, args.points, args.dims, k=args.k)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    xd, wd = x.to(dev), w.to(dev)
    fused_modes = [False, True] if cuda and available(Backend.TRITON, dev) else [False]
    for fused in fused_modes:  # warm-up: CUDA/cuBLAS start-up and Triton compilation are not seeding
        kmeans_pp_init(xd[:2], wd[:2], args.k, generator=torch.Generator().manual_seed(1), fused=fused)
    for fused in fused_modes:
        if cuda:
            torch.cuda.synchronize()
        t = time.time()
        init = kmeans_pp_init(xd, wd, args.k, generator=torch.Generator().manual_seed(1), fused=fused)
        if cuda:
            torch.cuda.synchronize()
        print(
            json.dumps(
                {
                    "what": "kmeans++ init",
                    "fused": fused,
                    "device": str(dev),
                    "problems": args.problems,
                    "seconds": round(time.time() - t, 3),
                }
            )
        )
    cfg = KMeansConfig(iterations=args.iterations, tolerance=0.0)  # device-dependent batch sizes
    for backend in args.backends:
        device = torch.device("cpu") if backend == "faiss" else dev
        try:
            if backend == "triton":  # warm-up: Triton compilation
                weighted_kmeans(
                    x[:2].to(device),
                    w[:2].to(device),
                    init[:2].to(device),
                    cfg=cfg,
                    backend=backend,
                    device=device,
                    seed=0,
                )
            t = time.time()
            res = weighted_kmeans(
                x.to(device), w.to(device), init.to(device), cfg=cfg, backend=backend, device=device, seed=0
            )
            if cuda:
                torch.cuda.synchronize()
            seconds = time.time() - t
        except (ImportError, ValueError) as err:
            print(json.dumps({"backend": backend, "error": str(err)}))
            continue
        print(
            json.dumps(
                {
                    "backend": backend,
                    "device": str(device),
                    "problems": args.problems,
                    "points": args.points,
                    "dims": args.dims,
                    "k": args.k,
                    "iterations": args.iterations,
                    "seconds": round(seconds, 3),
                    "ms_per_problem": round(1000 * seconds / args.problems, 2),
                    "objective_final_mean": round(res.objective_final.mean().item(), 6),
                    "threads": torch.get_num_threads(),
                }
            )
        )


if __name__ == "__main__":
    main()
