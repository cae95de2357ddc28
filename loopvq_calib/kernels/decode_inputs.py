"""What the decode-attention kernels read: one site's step tables, a block's coded tokens, the full-precision
tokens, and the per-call inputs in the dtypes the kernels read. The serving layer builds them
(:mod:`~loopvq_calib.serving.decode_attention`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepTables:
    """What the kernels read at one site: codeword values per channel and the code of each channel.

    ``key_a`` / ``key_b`` [H, K, D/2]: the first / second channel of every slot's RoPE pair (``half``: i and
    i + D/2; ``interleaved``: 2i and 2i+1, for pair i), divided by TaSQ's weight; ``key_code_a`` / ``key_code_b``
    [H, D/2] int32: their codes;
    ``value`` [H, K, D], ``value_code`` [H, D] int32 (key and value tables may differ in dtype); ``step`` the
    site's step in its block; ``tasq``: keys are multiplied by the token's sigma; ``rope_style`` the pairs'
    convention; ``key_pairs`` [H, D/2] int32: the RoPE pair (cos/sin column) of every key slot, or None when slot
    i holds pair i (a channels layout's pairs are put in code order, so that a code's channels sit side by side);
    ``lanes``: lanes per token -> the CUDA kernel's lane-order tables (or None where it does not serve the site),
    made on first use.
    """

    key_a: torch.Tensor
    key_b: torch.Tensor
    key_code_a: torch.Tensor
    key_code_b: torch.Tensor
    value: torch.Tensor
    value_code: torch.Tensor
    step: int
    tasq: bool
    rope_style: str
    key_pairs: torch.Tensor | None = None
    lanes: dict[int, Any] = field(default_factory=dict, repr=False)


@dataclass
class CodedTokens:
    """One block's coded tokens of a batch: ``key_indices`` [B, >=N, H, nk], ``value_indices`` [B, >=N, H, nv]
    (uint8 or int32), ``key_sigma`` [B, >=N, T_b] float16 (TaSQ) or None, ``count`` N valid tokens, and
    ``first_position`` [B] the position of each row's first coded token (the others follow one by one).
    ``live``: int32 [1] on the device, the valid tokens when only the device knows them (a static cache under a
    CUDA graph); ``count`` is then the capacity the launch is planned for and the kernels read min(count, live)."""

    key_indices: torch.Tensor
    value_indices: torch.Tensor
    key_sigma: torch.Tensor | None
    count: int
    first_position: torch.Tensor
    live: torch.Tensor | None = None


@dataclass(frozen=True)
class FullPrecisionTokens:
    """A site's tokens kept in full precision (sinks and window, at least the new one): ``keys`` / ``values``
    [B, S, H, D] pre-RoPE, ``positions`` [B, S], ``mask`` [B, S] (nonzero = attend) or None."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None = None


@dataclass
class KernelInputs:
    """What both kernels read besides the tables, in the dtypes they read: ``q`` contiguous, ``first`` [B]
    int32 (first coded position of each row), ``fp_positions`` [B, S] int32, ``fp_mask`` [B, S] int8 (or the
    positions again when there is no mask: never read; ``masked`` says which), ``sigma`` (TaSQ's fp16 sigmas,
    or a stand-in tensor when unread), ``cos`` / ``sin`` the RoPE table covering every position read."""

    q: torch.Tensor
    first: torch.Tensor
    fp_positions: torch.Tensor
    fp_mask: torch.Tensor
    sigma: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    masked: bool
