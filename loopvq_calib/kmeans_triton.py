"""A fused weighted Lloyd step for CUDA (Triton): nearest centroid and weighted accumulation in one pass.

The plain torch step materialises a [problems, points, K] distance tensor and scatters the points with
atomic adds, which makes it memory-bound. Here one program owns one problem: it keeps its K centroids
and the [K, G] accumulators on chip, streams the problem's points once, and writes per-centroid weighted
sums, weights and the weighted error. Distances and sums use 3-pass TF32 (about fp32 accuracy).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("loopvq_calib")
_disabled: list[str] = []

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch step is used instead
    triton = None


def available(x: torch.Tensor, k: int) -> bool:
    """Whether the fused step applies: CUDA tensors, Triton installed, G and K powers of two >= 16."""
    g = x.shape[-1]
    return bool(
        triton is not None and not _disabled and x.is_cuda and g >= 16 and k >= 16 and g & (g - 1) == 0 and k & (k - 1) == 0 and k <= 1024
    )


def disable(err: Exception) -> None:
    """Stop using the fused step for this process (logged once)."""
    _disabled.append(repr(err))
    log.warning("fused Triton Lloyd step failed (%r); using the torch step", err)


if triton is not None:

    @triton.jit
    def _lloyd_kernel(x_ptr, w_ptr, c_ptr, sums_ptr, mass_ptr, err_ptr, n_points: tl.constexpr,
                      K: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        kk = tl.arange(0, K)
        gg = tl.arange(0, G)
        c = tl.load(c_ptr + p * K * G + kk[:, None] * G + gg[None, :])  # [K, G]
        c_sq = tl.sum(c * c, axis=1)
        acc = tl.zeros((K, G), dtype=tl.float32)
        mass = tl.zeros((K,), dtype=tl.float32)
        err = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, n_points, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            valid = rows < n_points
            x = tl.load(x_ptr + p * n_points * G + rows[:, None] * G + gg[None, :], mask=valid[:, None], other=0.0)
            w = tl.load(w_ptr + p * n_points + rows, mask=valid, other=0.0)
            d = c_sq[None, :] - 2.0 * tl.dot(x, tl.trans(c), input_precision=PRECISION)  # [BLOCK_N, K]
            dmin = tl.min(d, axis=1)
            idx = tl.argmin(d, axis=1)
            err += w * tl.maximum(dmin + tl.sum(x * x, axis=1), 0.0)
            onehot = tl.where(idx[:, None] == kk[None, :], w[:, None], 0.0)  # weighted one-hot [BLOCK_N, K]
            acc += tl.dot(tl.trans(onehot), x, input_precision=PRECISION)
            mass += tl.sum(onehot, axis=0)
        tl.store(sums_ptr + p * K * G + kk[:, None] * G + gg[None, :], acc)
        tl.store(mass_ptr + p * K + kk, mass)
        tl.store(err_ptr + p, tl.sum(err, axis=0))


def lloyd_step(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, block_n: int = 32,
               precision: str = "tf32x3") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [P, N, G], w [P, N], c [P, K, G] (fp32) -> (weighted error [P], sums [P, K, G], weights [P, K])."""
    p, n, g = x.shape
    k = c.shape[1]
    x, w, c = (t.float().contiguous() for t in (x, w, c))
    sums = torch.empty(p, k, g, device=x.device, dtype=torch.float32)
    mass = torch.empty(p, k, device=x.device, dtype=torch.float32)
    err = torch.empty(p, device=x.device, dtype=torch.float32)
    _lloyd_kernel[(p,)](x, w, c, sums, mass, err, n, K=k, G=g, BLOCK_N=block_n, PRECISION=precision,
                        num_warps=4 if k <= 256 else 8)
    return err, sums, mass
