"""Codeword lookup straight into block order in one fused Triton kernel on CUDA.

The torch path copies each code's codeword into group order ([N, H*n, G], ``index_select``) and then moves every
coordinate to its place in the block ([N, T, H, D], a gather): two passes over the decoded block, the first
of them slow for 16-value rows. Here one program writes a [tokens, coordinates] tile of the block, reading for
each coordinate its group element (a table computed once per layout), that group's code and the codeword
value. The values are exact copies (its gradient is the caller's: an ``index_add_`` into the codebook rows).

:func:`candidate` is the kernel's entry in the codec's dispatch (:mod:`~loopvq_calib.kernels.backends`): fp32
codebooks on CUDA where :func:`probe` (compiles, runs and copies what a plain torch gather copies) passes.
Runs on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it without
a GPU.
"""

from __future__ import annotations

import torch

from ..runtime.devices import indexed_device
from .backends import Backend, Candidate, tl, triton

TOKENS, COORDS = 32, 256  # tile of one program
LABEL = "the fused codeword-lookup kernel"


if triton is not None:
    # no integer argument is specialised on: the probe compiles the kernel every later call runs
    @triton.jit(do_not_specialize=["n_tok", "n_groups", "head_stride", "group_stride", "hn", "coords", "k", "g"])
    def _lookup_kernel(
        idx_ptr,
        cb_ptr,
        src_ptr,
        out_ptr,
        n_tok,
        n_groups,
        head_stride,
        group_stride,
        hn,
        coords,
        k,
        g,
        TOKENS: tl.constexpr,
        COORDS: tl.constexpr,
    ):
        f = tl.program_id(1) * COORDS + tl.arange(0, COORDS)
        f_in = f < coords
        e = tl.load(src_ptr + f, mask=f_in, other=0)  # group element (problem * G + j) of block coordinate f
        p = e // g
        book = (p // n_groups) * head_stride + (p % n_groups) * group_stride
        t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
        inside = (t < n_tok)[:, None] & f_in[None, :]
        code = tl.load(idx_ptr + t[:, None] * hn + p[None, :], mask=inside, other=0).to(tl.int64)
        value = tl.load(cb_ptr + (book[None, :].to(tl.int64) * k + code) * g + (e % g)[None, :], mask=inside, other=0.0)
        tl.store(out_ptr + t[:, None] * coords + f[None, :], value, mask=inside)


def lookup_block(
    indices: torch.Tensor, codebook: torch.Tensor, to_block: torch.Tensor, *, steps: int, head_dim: int
) -> torch.Tensor:
    """Codewords of ``indices`` [N, H, n] from ``codebook`` [Hc, nc, K, G] (shared heads or groups broadcast)
    placed in block order [N, steps, H, head_dim]: block coordinate f of a token is group element
    ``to_block[f]`` (head-major group order, G per group). No gradient."""
    n_tok, h, n = indices.shape
    hc, nc, k, g = codebook.shape
    out = torch.empty(n_tok, steps, h, head_dim, dtype=codebook.dtype, device=codebook.device)
    f = steps * h * head_dim
    if n_tok:
        grid = (triton.cdiv(n_tok, TOKENS), triton.cdiv(f, COORDS))
        _lookup_kernel[grid](
            indices.contiguous(),
            codebook.detach().contiguous(),
            to_block,
            out,
            n_tok,
            n,
            0 if hc == 1 else nc,
            0 if nc == 1 else 1,
            h * n,
            f,
            k,
            g,
            TOKENS=TOKENS,
            COORDS=COORDS,
            num_warps=4,
        )
    return out


def reference(
    indices: torch.Tensor, codebook: torch.Tensor, to_block: torch.Tensor, *, steps: int, head_dim: int
) -> torch.Tensor:
    """:func:`lookup_block` in plain torch (the probe's check)."""
    n_tok, h, n = indices.shape
    books = codebook.expand(h, n, -1, -1)  # [H, n, K, G]
    z = books[torch.arange(h)[:, None], torch.arange(n)[None, :], indices.long()]  # [N, H, n, G]
    return z.reshape(n_tok, -1)[:, to_block].view(n_tok, steps, h, head_dim)


def probe(device: torch.device) -> None:
    """Compile and run the kernel on ``device``; raises unless it copies :func:`reference`'s values exactly on a
    probe (3 heads of 2 groups of 16, 2 steps of 16 channels, shared codebook groups)."""
    gen = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 16, (40, 3, 2), generator=gen, dtype=torch.uint8)
    codebook = torch.randn(3, 1, 16, 16, generator=gen)
    to_block = torch.randperm(3 * 2 * 16, generator=gen)
    want = reference(indices, codebook, to_block, steps=2, head_dim=16)
    got = lookup_block(indices.to(device), codebook.to(device), to_block.to(device), steps=2, head_dim=16).cpu()
    if not torch.equal(got, want):
        raise RuntimeError("it does not copy the torch reference's values")


def candidate(device: torch.device, dtype: torch.dtype) -> Candidate:
    """The kernel's candidate in the codec's dispatch for codebooks of ``dtype`` on ``device`` (float32 only:
    what it was checked for)."""
    where = indexed_device(device)
    return Candidate(
        Backend.TRITON,
        LABEL,
        auto=where.type == "cuda" and dtype == torch.float32,  # else torch, silently
        unfit=lambda: "" if dtype == torch.float32 else f"a {dtype} codebook (it reads float32)",
        probe=lambda: probe(where),
        probe_key=("lookup", str(where)),
    )
