"""Tile and precision choices of the fused Lloyd kernel (loopvq_calib/kernels/kmeans.py) on one GPU.

On 512 problems of Ouro-1.4B's k-means shape (32,640 points of 16 dims, K 256), times one Lloyd step of
the torch path and of the Triton kernel for each dot precision (tf32x3, ieee, tf32), points per program and
warps, with and without the cluster-sum atomics; compares each against the torch step (relative error of
the weighted objective, largest difference of the cluster weights and sums), then times k-means++ seeding
with the torch draws and the fused kernels. One JSON line per measurement.

    python benchmarks/calibration/tune_kmeans_kernels.py

The sweep in benchmarks/results/tune-kmeans-kernels-h200.jsonl ran at `d2a1f64`, with a two-axis grid of (problem,
block); the kernel now takes one flat axis in the same order, problems fastest.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch
import triton

from benchmarks.calibration.bench_kmeans import problems
from loopvq_calib.calibration.kmeans.seeding import kmeans_pp_init
from loopvq_calib.calibration.kmeans.solvers import _assign
from loopvq_calib.kernels import kmeans as kmeans_triton

P, N, G, K = 512, 32640, 16, 256


def ms_per_call(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.time()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.time() - start) / reps * 1000


def main() -> None:
    x, w = problems(P, N, G, k=K)
    x, w = x.cuda().contiguous(), w.cuda().contiguous()
    c = x[:, torch.randperm(N, generator=torch.Generator().manual_seed(0))[:K]].contiguous()
    rows = torch.arange(P, device="cuda")
    x_sq = x.pow(2).sum(-1)
    err0, sums0, mass0 = _assign(x, x_sq, w, c=c, chunk=16384, accumulate=True)
    torch_ms = ms_per_call(lambda: _assign(x, x_sq, w, c=c, chunk=16384, accumulate=True))
    print(json.dumps({"torch_assign_ms": round(torch_ms, 2)}), flush=True)

    def step(
        block: int, warps: int, precision: str, *, accumulate: bool
    ) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
        nb = triton.cdiv(N, block)
        err = torch.empty(P, nb, device="cuda")
        sums, mass = torch.zeros(P, K, G, device="cuda"), torch.zeros(P, K, device="cuda")

        def run() -> None:
            sums.zero_()
            mass.zero_()
            kmeans_triton._lloyd_kernel[(P * nb,)](
                x,
                w,
                c,
                rows,
                err,
                sums,
                mass,
                N,
                P,
                nb,
                K=K,
                G=G,
                KP=K,
                GP=G,
                BLOCK=block,
                ACCUMULATE=accumulate,
                PRECISION=precision,
                num_warps=warps,
            )

        return ms_per_call(run), err.sum(1), sums, mass

    for precision in ("tf32x3", "ieee", "tf32"):
        for block in (32, 64, 128):
            for warps in (4, 8):
                ms, err, sums, mass = step(block, warps, precision, accumulate=True)
                print(
                    json.dumps(
                        {
                            "prec": precision,
                            "block": block,
                            "warps": warps,
                            "ms": round(ms, 2),
                            "ms_no_accumulate": round(step(block, warps, precision, accumulate=False)[0], 2),
                            "err_rel": ((err - err0).abs() / err0).max().item(),
                            "mass_diff": (mass - mass0).abs().max().item(),
                            "sums_diff": (sums - sums0).abs().max().item(),
                        }
                    ),
                    flush=True,
                )

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(1)

    for fused in (True, False):  # warm-up (compilation)
        kmeans_pp_init(x[:2], w[:2], K, generator=gen(), fused=fused)
    seeds = {}
    for fused in (True, False):
        torch.cuda.synchronize()
        start = time.time()
        seeds[fused] = kmeans_pp_init(x, w, K, generator=gen(), fused=fused)
        torch.cuda.synchronize()
        print(json.dumps({"pp_fused": fused, "s": round(time.time() - start, 3)}), flush=True)
    print(json.dumps({"pp_equal_rows": (seeds[True] == seeds[False]).all(-1).all(-1).float().mean().item()}))


if __name__ == "__main__":
    main()
