"""Compile and check the codec's kernels ahead of their first use (a background warm-up job)."""

from __future__ import annotations

import torch

from . import lookup, nearest
from .backends import DISPATCH


def prepare_codec_kernels(device: torch.device | str, *, k: int, g: int) -> dict[str, str]:
    """Probe the fused nearest-codeword kernel (codebooks of ``k`` x ``g``) and the codeword-lookup kernel
    (float32 codebooks) on ``device`` where the codec's dispatch considers them, under the keys its first
    encode and decode then find (:data:`~loopvq_calib.kernels.backends.DISPATCH`). Returns, per kernel it
    considers, why it will not serve ('' when it will)."""
    device = torch.device(device)
    kernels = (nearest.candidate(device, k, g), lookup.candidate(device, torch.float32))
    return {c.label: DISPATCH.why_not(c, device) for c in kernels if c.auto}
