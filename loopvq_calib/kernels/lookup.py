"""Codeword lookup straight into block order in one fused Triton kernel on CUDA (``BlockCodec.decode``'s GPU path).

The torch path copies each code's codeword into group order ([N, H*n, G], ``index_select``) and then moves every
coordinate to its place in the block ([N, T, H, D], a gather): two passes over the decoded block, the first
of them slow for 16-value rows. Here one program writes a [tokens, coordinates] tile of the block, reading for
each coordinate its group element (a table computed once per layout), that group's code and the codeword
value. The values are exactly the torch path's (copies); the backward is the torch path's backward written
out: the gradient gathered into group order and added into the codebook rows with ``index_add_``.

Used for fp32 codebooks on CUDA devices where :func:`works` holds, the torch path everywhere else. Runs on CPU
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
TOKENS, COORDS = 32, 256  # tile of one program


if triton is not None:

    # no integer argument is specialised on: the probe in works() compiles the kernel every later call runs
    @triton.jit(do_not_specialize=["n_tok", "n_groups", "head_stride", "group_stride", "hn", "coords", "k", "g"])
    def _lookup_kernel(idx_ptr, cb_ptr, src_ptr, out_ptr, n_tok, n_groups, head_stride, group_stride, hn, coords, k, g,
                       TOKENS: tl.constexpr, COORDS: tl.constexpr):
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


def _lookup_block(indices: torch.Tensor, codebook: torch.Tensor, to_block: torch.Tensor, *, steps: int, head_dim: int) -> torch.Tensor:
    n_tok, h, n = indices.shape
    hc, nc, k, g = codebook.shape
    out = torch.empty(n_tok, steps, h, head_dim, dtype=codebook.dtype, device=codebook.device)
    f = steps * h * head_dim
    if n_tok:
        grid = (triton.cdiv(n_tok, TOKENS), triton.cdiv(f, COORDS))
        _lookup_kernel[grid](indices.contiguous(), codebook.detach().contiguous(), to_block, out, n_tok, n,
                             0 if hc == 1 else nc, 0 if nc == 1 else 1, h * n, f, k, g, TOKENS=TOKENS, COORDS=COORDS,
                             num_warps=4)
    return out


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, codebook, indices, to_block, to_groups, steps, head_dim):  # type: ignore[override]
        ctx.save_for_backward(indices, to_groups)
        ctx.book_shape = codebook.shape
        return _lookup_block(indices, codebook, to_block, steps=steps, head_dim=head_dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        from ..codes.codec import _flat_codebook_index

        indices, to_groups = ctx.saved_tensors
        n_tok, g = indices.shape[0], ctx.book_shape[-1]
        grad_z = grad.reshape(n_tok, -1).gather(-1, to_groups.expand(n_tok, -1))  # group order [N, H*n*G]
        rows = _flat_codebook_index(indices, torch.empty(ctx.book_shape, device="meta"))
        flat = grad.new_zeros(ctx.book_shape.numel() // g, g).index_add_(0, rows.reshape(-1), grad_z.view(-1, g))
        return flat.view(ctx.book_shape), None, None, None, None, None


def decode_block(indices: torch.Tensor, codebook: torch.Tensor, to_block: torch.Tensor, *, to_groups: torch.Tensor,
                 steps: int, head_dim: int) -> torch.Tensor:
    """Codewords of ``indices`` [N, H, n] from ``codebook`` [Hc, nc, K, G] (fp32) placed in block order
    [N, steps, H, head_dim] (``to_block``/``to_groups``: ``codec.block_permutation``); differentiable
    w.r.t. the codebook."""
    return _Lookup.apply(codebook, indices, to_block, to_groups, steps, head_dim)


@functools.lru_cache(maxsize=None)
def works(device: str) -> bool:
    """Whether the kernel compiles, runs and copies exactly what the torch path does on ``device`` (once per
    process and device)."""
    from ..codes.codec import BlockCodec, Codes
    from ..codes.layouts import BlockLayout

    try:
        gen = torch.Generator().manual_seed(0)
        groups = torch.stack([torch.randperm(2 * 16, generator=gen) for _ in range(3)]).view(3, 2, 16)
        codec = BlockCodec(BlockLayout("probe", "key", (0, 1), 16, 3, groups), torch.randn(3, 2, 16, 16, generator=gen))
        codes = Codes(torch.randint(0, 16, (40, 3, 2), generator=gen, dtype=torch.uint8))
        want = codec.decode(codes)  # on the CPU: the torch path
        to_groups, to_block = (t.to(device) for t in codec.permutation(3, 16, torch.device("cpu")))
        got = decode_block(codes.indices.to(device), codec.codebook.to(device), to_block, to_groups=to_groups, steps=2, head_dim=16).cpu()
        if not torch.equal(got, want):
            raise RuntimeError("it does not copy the torch path's values")
        return True
    except Exception as err:  # compiler, driver or launch failure: use torch
        log.warning("the fused codeword-lookup kernel does not run on %s (%s: %s); using torch", device,
                    type(err).__name__, err)
        return False


def usable(codebook: torch.Tensor) -> bool:
    """Whether :func:`decode_block` takes this codebook: fp32 on a CUDA device where it works."""
    return codebook.is_cuda and codebook.dtype == torch.float32 and available(codebook.device) \
        and works(str(codebook.device))
