"""k-means++ seeding with the fused kernels at Ouro-1.4B's k-means shape (512 problems of 32,640 points x 16
dims, K = 256, one layout), against another version of ``kmeans_triton.py`` (e.g. ``git show
296ed1a:loopvq_calib/kmeans_triton.py > /tmp/old.py``): seconds per layout (best of 3, after a warm-up that
compiles) and whether both draw the same centroids. One JSON line per version.

    python scripts/bench_kmeans_seeding.py --reference /tmp/old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kmeans import problems  # noqa: E402

from loopvq_calib.kernels import kmeans as kmeans_triton  # noqa: E402


def load(path: str):
    spec = importlib.util.spec_from_file_location("reference_kmeans_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=512)
    ap.add_argument("--points", type=int, default=32640)
    ap.add_argument("--dims", type=int, default=16)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--offset", type=float, default=0.0, help="added to every coordinate (keys far from the origin)")
    ap.add_argument("--reference", default=None, help="another kmeans_triton.py to compare with")
    ap.add_argument("--subs", type=int, nargs="+", default=[kmeans_triton.DRAW_SUB],
                    help="points per step of the current D^2 update (DRAW_SUB) to try")
    ap.add_argument("--warps", type=int, nargs="+", default=[kmeans_triton.DRAW_WARPS],
                    help="warps per program of the current D^2 update (DRAW_WARPS) to try")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w = problems(args.problems, args.points, args.dims, args.k, gen=gen)
    x, w = x + args.offset, w.contiguous()
    uniforms = torch.rand(args.k, args.problems, dtype=torch.float64, device="cuda", generator=gen)
    versions = [(f"current, DRAW_SUB {sub}, DRAW_WARPS {warps}", kmeans_triton, (sub, warps))
                for sub in args.subs for warps in args.warps]
    if args.reference:
        versions.append(("reference", load(args.reference), None))
    out = {}
    for name, module, tile in versions:
        if tile is not None:
            module.DRAW_SUB, module.DRAW_WARPS = tile
        module.kmeans_pp(x[:2].contiguous(), w[:2].contiguous(), args.k, uniforms=uniforms[:, :2].contiguous())  # compiles
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out[name] = module.kmeans_pp(x, w, args.k, uniforms=uniforms)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        print(json.dumps({"version": name, "problems": args.problems, "points": args.points, "k": args.k,
                          "offset": args.offset, "seconds": [round(t, 4) for t in times],
                          "same_centroids_as_first": bool(torch.equal(out[name], out[versions[0][0]]))}), flush=True)


if __name__ == "__main__":
    main()
