"""The tiny whole-model decode bench run (benchmarks/decode/bench_decode_model.py) shared by its tests."""

from __future__ import annotations

import torch


def tiny_bench_args(device: torch.device) -> list[str]:
    """``argv`` of a 1/16-scale Ouro-1.4B at context 90, batch 2, one warm-up and 8 timed steps on ``device``."""
    return [
        "bench_decode_model.py",
        *("--scale-down", "16", "--contexts", "90", "--batches", "2", "--warmup", "1", "--steps", "8"),
        *("--device", str(device)),
    ]
