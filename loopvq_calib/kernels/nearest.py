"""The nearest codeword of every group vector in one fused Triton kernel on CUDA (``codec.nearest``'s GPU path).

The torch path writes a [H*n, N, K] fp32 distance block per chunk of tokens (1 GB for one Ouro-1.4B block
of 2,048 tokens) and reads it back to take the minimum; fine-tuning does this for every block at every step.
Here one program takes 64 tokens of one (head, group) problem: it loads that problem's K codewords, keeps
the [64, K] distances ||c||^2 - 2 z.c in registers (an fp32 dot, ``ieee`` precision) and writes only the
index of the smallest, the lowest index on ties. The distances are the torch path's up to the order of the
fp32 sums, so a token whose two nearest codewords are within rounding of each other may get the other one.

Used on CUDA devices where :func:`works` (triton importable, compute capability 8.0 or newer, the kernel
compiles and agrees with the torch path on a probe) holds; the torch path everywhere else. Runs on CPU
tensors in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import functools
import logging

import torch

from .kmeans import (  # the same triton import and device test as the k-means kernels
    available,
    tl,
    triton,
)

log = logging.getLogger("loopvq_calib")
BLOCK = 64  # tokens per program: a [64, K] fp32 distance tile in registers
MAX_K = 256  # the codebook sizes the kernel was written and timed for (a [64, 512] tile spills registers)
MAX_TILE = 256 * 32  # K x G codebook entries a program holds


def supports(k: int, g: int) -> bool:
    """Powers of two with 16 <= K <= ``MAX_K``, G >= 16 (the dot's smallest inner size) and K x G <=
    ``MAX_TILE``; larger codebooks take the torch path."""
    return k & (k - 1) == 0 and g & (g - 1) == 0 and g >= 16 and 16 <= k <= MAX_K and k * g <= MAX_TILE


if triton is not None:

    # no integer argument is specialised on: the probe in works() compiles the kernel every later call runs
    @triton.jit(do_not_specialize=["n_tok", "n_groups", "head_stride", "group_stride", "hn"])
    def _nearest_kernel(z_ptr, cb_ptr, out_ptr, n_tok, n_groups, head_stride, group_stride, hn,
                        K: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr):
        blk = tl.program_id(0)
        p = tl.program_id(1)  # problem: head * n_groups + group; its codebook: head * head_stride + group * group_stride
        book = (p // n_groups) * head_stride + (p % n_groups) * group_stride
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        g = tl.arange(0, G)
        k = tl.arange(0, K)
        z = tl.load(z_ptr + rows.to(tl.int64)[:, None] * (hn * G) + p * G + g[None, :],
                    mask=rows[:, None] < n_tok, other=0.0)
        cb = tl.load(cb_ptr + book.to(tl.int64) * (K * G) + k[:, None] * G + g[None, :])
        sq = tl.sum(cb * cb, axis=1)
        dist = sq[None, :] - 2.0 * tl.dot(z, tl.trans(cb), input_precision="ieee")
        best = tl.argmin(dist, axis=1, tie_break_left=True)
        tl.store(out_ptr + rows.to(tl.int64) * hn + p, best.to(tl.int64), mask=rows < n_tok)


def nearest(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """``codec.nearest`` in one kernel: z [N, H, n, G], codebook [Hc, nc, K, G] (fp32) -> [N, H, n] int64."""
    n_tok, h, n, g = z.shape
    hc, nc, k, _ = codebook.shape
    out = torch.empty(n_tok, h, n, dtype=torch.long, device=z.device)
    if n_tok:
        grid = (triton.cdiv(n_tok, BLOCK), h * n)
        _nearest_kernel[grid](z.detach().float().contiguous(), codebook.detach().float().contiguous(), out, n_tok, n,
                              0 if hc == 1 else nc, 0 if nc == 1 else 1, h * n, K=k, G=g, BLOCK=BLOCK, num_warps=4)
    return out


@functools.lru_cache(maxsize=None)
def works(device: str, k: int, g: int) -> bool:
    """Whether the kernel compiles, runs and agrees with the torch path on ``device`` for codebooks of ``k`` x
    ``g`` (once per process, device and shape; compiling here is what the first real call would pay)."""
    from ..codes.codec import nearest as torch_nearest

    try:
        gen = torch.Generator().manual_seed(0)
        z = torch.randn(100, 2, 3, g, generator=gen)
        cb = torch.randn(2, 3, k, g, generator=gen)
        want = torch_nearest(z, cb)  # on the CPU
        got = nearest(z.to(device), cb.to(device)).cpu()
        agree = float((got == want).float().mean())
        if agree < 0.99:
            raise RuntimeError(f"it agrees with the torch path on {agree:.1%} of a probe's codes")
        return True
    except Exception as err:  # compiler, driver or launch failure: use torch
        log.warning("the fused nearest-codeword kernel does not run on %s (%s: %s); using torch", device,
                    type(err).__name__, err)
        return False


def usable(z: torch.Tensor, codebook: torch.Tensor) -> bool:
    """Whether :func:`nearest` takes these operands: CUDA tensors on a device where it works, a supported
    shape (the interpreter is for tests, which call :func:`nearest` themselves)."""
    k, g = codebook.shape[-2:]
    return z.is_cuda and available(z.device) and supports(k, g) and works(str(z.device), k, g)
