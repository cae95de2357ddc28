"""TaSQ's grouping fit (merge costs + matching, all heads of one key layout) at
real shapes on random covariances; prints one JSON line with the seconds per layout. The covariance computation and
the capture reads are not included (the TaSQ stage's whole time: docs/performance.md).

    python benchmarks/calibration/bench_tasq_grouping.py --heads 16 --head-dim 128 --steps 4 --group-size 16  # Ouro
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from loopvq_calib.calibration.tasq.grouping import fit_groups, rope_pair_units


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2048, help="samples behind each random covariance")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    coords = args.steps * args.head_dim
    units = rope_pair_units(args.head_dim, args.steps, "half")
    seconds = []
    for seed in range(args.repeats):
        gen = torch.Generator().manual_seed(seed)
        mix = (
            torch.eye(coords, dtype=torch.float64)
            + 0.3 * torch.randn(args.heads, coords, coords, generator=gen, dtype=torch.float64) / coords**0.5
        )
        y = torch.randn(args.heads, args.tokens, coords, generator=gen, dtype=torch.float64) @ mix
        cov = y.transpose(1, 2) @ y / args.tokens
        start = time.perf_counter()
        fit_groups(cov, units, args.group_size, eps=1e-6)
        seconds.append(round(time.perf_counter() - start, 3))
    print(json.dumps({**vars(args), "seconds_per_layout": seconds, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
