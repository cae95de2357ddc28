"""The nearest codeword of every group vector in one fused Triton kernel on CUDA.

The torch path writes a [H*n, N, K] fp32 distance block per chunk of tokens (1 GB for one Ouro-1.4B block
of 2,048 tokens) and reads it back to take the minimum; fine-tuning does this for every block at every step.
Here one program takes 64 tokens of one (head, group) problem: it loads that problem's K codewords, keeps
the [64, K] distances ||c||^2 - 2 z.c in registers (an fp32 dot, ``ieee`` precision) and writes only the
index of the smallest, the lowest index on ties. The distances are the torch path's up to the order of the
fp32 sums, so a token whose two nearest codewords are within rounding of each other may get the other one.

:func:`candidate` is the kernel's entry in the codec's dispatch (:mod:`~loopvq_calib.kernels.backends`): on
CUDA, for the shapes :func:`supports` takes, where :func:`probe` (compiles, runs and agrees with a plain torch
argmin) passes. Runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check it without a GPU.
"""

from __future__ import annotations

import torch

from ..runtime.devices import indexed_device
from .backends import Backend, Candidate, tl, triton

BLOCK = 64  # tokens per program: a [64, K] fp32 distance tile in registers
MAX_K = 256  # the codebook sizes the kernel was written and timed for (a [64, 512] tile spills registers)
MAX_TILE = 256 * 32  # K x G codebook entries a program holds
LABEL = "the fused nearest-codeword kernel"


def supports(k: int, g: int) -> bool:
    """Powers of two with 16 <= K <= ``MAX_K``, G >= 16 (the dot's smallest inner size) and K x G <=
    ``MAX_TILE``; larger codebooks take the torch path."""
    return k & (k - 1) == 0 and g & (g - 1) == 0 and g >= 16 and 16 <= k <= MAX_K and k * g <= MAX_TILE


if triton is not None:
    # no integer argument is specialised on: the probe compiles the kernel every later call runs
    @triton.jit(do_not_specialize=["n_tok", "n_groups", "head_stride", "group_stride", "hn"])
    def _nearest_kernel(
        z_ptr,
        cb_ptr,
        out_ptr,
        n_tok,
        n_groups,
        head_stride,
        group_stride,
        hn,
        K: tl.constexpr,
        G: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        blk = tl.program_id(0)
        p = tl.program_id(
            1
        )  # problem: head * n_groups + group; its codebook: head * head_stride + group * group_stride
        book = (p // n_groups) * head_stride + (p % n_groups) * group_stride
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        g = tl.arange(0, G)
        k = tl.arange(0, K)
        z = tl.load(
            z_ptr + rows.to(tl.int64)[:, None] * (hn * G) + p * G + g[None, :], mask=rows[:, None] < n_tok, other=0.0
        )
        cb = tl.load(cb_ptr + book.to(tl.int64) * (K * G) + k[:, None] * G + g[None, :])
        sq = tl.sum(cb * cb, axis=1)
        dist = sq[None, :] - 2.0 * tl.dot(z, tl.trans(cb), input_precision="ieee")
        best = tl.argmin(dist, axis=1, tie_break_left=True)
        tl.store(out_ptr + rows.to(tl.int64) * hn + p, best.to(tl.int64), mask=rows < n_tok)


def nearest(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codeword for each group vector in one kernel: z [N, H, n, G], codebook [Hc, nc,
    K, G] (fp32; shared heads or groups broadcast) -> [N, H, n] int64."""
    n_tok, h, n, g = z.shape
    hc, nc, k, _ = codebook.shape
    out = torch.empty(n_tok, h, n, dtype=torch.long, device=z.device)
    if n_tok:
        grid = (triton.cdiv(n_tok, BLOCK), h * n)
        _nearest_kernel[grid](
            z.detach().float().contiguous(),
            codebook.detach().float().contiguous(),
            out,
            n_tok,
            n,
            0 if hc == 1 else nc,
            0 if nc == 1 else 1,
            h * n,
            K=k,
            G=g,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out


def reference(z: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """:func:`nearest` in plain torch, float64 (the probe's check): the lowest index of the smallest squared
    distance."""
    h, n = z.shape[1:3]
    books = codebook.double().expand(h, n, -1, -1)  # [H, n, K, G]
    dist = (z.double()[:, :, :, None, :] - books[None]).pow(2).sum(-1)  # [N, H, n, K]
    return dist.argmin(-1)


def probe(device: torch.device, k: int, g: int) -> None:
    """Compile and run the kernel for codebooks of ``k`` x ``g`` on ``device`` (what the first real call would
    compile); raises unless it picks :func:`reference`'s codeword for at least 99 % of a probe's vectors."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(100, 2, 3, g, generator=gen)
    cb = torch.randn(2, 3, k, g, generator=gen)
    got = nearest(z.to(device), cb.to(device)).cpu()
    agree = float((got == reference(z, cb)).float().mean())
    if agree < 0.99:
        raise RuntimeError(f"it agrees with the torch reference on {agree:.1%} of a probe's codes")


def candidate(device: torch.device, k: int, g: int) -> Candidate:
    """The kernel's candidate in the codec's dispatch for codebooks of ``k`` x ``g`` on ``device``."""
    where = indexed_device(device)
    return Candidate(
        Backend.TRITON,
        LABEL,
        auto=where.type == "cuda" and supports(k, g),  # else torch, silently
        unfit=lambda: (
            ""
            if supports(k, g)
            else f"codebooks of {k} x {g} (it takes powers of two, 16 <= K <= {MAX_K}, G >= 16, K x G <= {MAX_TILE})"
        ),
        probe=lambda: probe(where, k, g),
        probe_key=("nearest", str(where), k, g),
    )
