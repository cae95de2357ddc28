"""The reference encoder and decoder used by every later stage, the bundle reader and the quantized cache.

Shapes: a block's input is x [N, T, H, D] (N tokens, the block's T loop steps, H KV heads, D channels),
pre-RoPE for keys. Encoding gathers each head's flat T*D vector into code groups ([N, H, n_groups, G]),
optionally after the TaSQ transform, and picks the nearest codeword by squared distance in the space
the codebook lives in. Decoding looks codewords up (exact gradients w.r.t. the codebook entries),
scatters them back and undoes the transform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..kernels import lookup as lookup_kernel, nearest as nearest_kernel
from ..kernels.backends import CODEC_CHOICES, DISPATCH, Backend, Candidate
from ..runtime.streams import to_device
from .layouts import BlockLayout


@dataclass
class TasqTransform:
    """TaSQ on keys: y = x * w / sigma (docs/bundle-format.md gives the exact sigma rule).

    ``weight`` [T, H, D]: per (step, head, channel) weights w (mean(w^2) = 1 per head and step).
    sigma per (token, step): RMS of the weighted key over all heads and channels of that site,
    clamped to >= ``sigma_min`` and rounded to fp16 (stored as fp16 next to the indices).
    """

    weight: torch.Tensor
    sigma_min: float = 1e-4

    def on(self, device: torch.device) -> TasqTransform:
        """This transform with its weights on ``device`` (itself when they are there): a stage that applies it
        many times copies the weights once."""
        return self if self.weight.device == device else TasqTransform(to_device(self.weight, device), self.sigma_min)

    def sigma(self, x: torch.Tensor) -> torch.Tensor:
        """[N, T, H, D] -> [N, T] float16."""
        wx = x.float() * to_device(self.weight, x.device)
        rms = wx.pow(2).mean(dim=(-1, -2)).sqrt().clamp_min(self.sigma_min)
        return rms.to(torch.float16)

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return x * to_device(self.weight, x.device) / sigma.to(x.dtype)[..., None, None]

    def inverse(self, y: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return y * sigma.to(y.dtype)[..., None, None] / to_device(self.weight, y.device)


@dataclass
class Codes:
    """Encoded block: ``indices`` [N, H, n_groups] (uint8 for K <= 256, else int32), ``sigma`` [N, T] fp16."""

    indices: torch.Tensor
    sigma: torch.Tensor | None = None


def index_dtype(codebook_size: int) -> torch.dtype:
    return torch.uint8 if codebook_size <= 256 else torch.int32


def flatten_block(x: torch.Tensor) -> torch.Tensor:
    """[N, T, H, D] -> [N, H, T*D] with flat coordinate m*D + channel."""
    n, t, h, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(n, h, t * d)


def unflatten_block(xf: torch.Tensor, steps: int) -> torch.Tensor:
    """[N, H, T*D] -> [N, T, H, D]."""
    n, h, td = xf.shape
    return xf.view(n, h, steps, td // steps).permute(0, 2, 1, 3)


def gather_groups(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Group vectors of a block: x [N, T, H, D], groups [1|H, n, G] -> [N, H, n, G]."""
    xf = flatten_block(x)
    n, h, _ = xf.shape
    idx = to_device(groups, x.device).expand(h, -1, -1).reshape(1, h, -1).expand(n, -1, -1)
    return xf.gather(-1, idx).view(n, h, *groups.shape[1:])


def scatter_groups(z: torch.Tensor, groups: torch.Tensor, steps: int) -> torch.Tensor:
    """Inverse of :func:`gather_groups` (groups partition the coordinates): [N, H, n, G] -> [N, T, H, D]."""
    n, h = z.shape[:2]
    inverse = to_device(groups, z.device).expand(h, -1, -1).reshape(h, -1).argsort(-1)
    zf = z.reshape(n, h, -1).gather(-1, inverse[None].expand(n, -1, -1))
    return unflatten_block(zf, steps)


def block_permutation(
    groups: torch.Tensor, steps: int, heads: int, *, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group coordinates of a block as flat positions in one token's contiguous [T, H, D] slice:
    ``to_groups`` [H * n * G], position of each group element in :func:`gather_groups` order, and its
    inverse ``to_block`` [T * H * D], the group element each position is read from in
    :func:`scatter_groups`. One gather with either replaces the head-major copy and the gather of those
    functions (the same values, moved once)."""
    g = groups.to(device).expand(heads, -1, -1).reshape(heads, -1)  # flat m * D + channel per head
    if g.shape[1] != steps * head_dim:
        raise ValueError(f"groups cover {g.shape[1]} of the {steps * head_dim} coordinates of a head")
    head = torch.arange(heads, device=device)[:, None]
    to_groups = ((g // head_dim) * heads * head_dim + head * head_dim + g % head_dim).reshape(-1)
    to_block = torch.empty_like(to_groups)
    to_block[to_groups] = torch.arange(to_groups.numel(), device=device)
    return to_groups, to_block


def flat_codebook_index(indices: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Row of each code in ``codebook.view(-1, G)``; shared heads/groups broadcast."""
    hc, gc, k, _ = codebook.shape
    _, h, n = indices.shape
    head = (
        torch.arange(h, device=indices.device)[:, None]
        if hc > 1
        else torch.zeros(h, 1, dtype=torch.long, device=indices.device)
    )
    grp = (
        torch.arange(n, device=indices.device)[None, :]
        if gc > 1
        else torch.zeros(1, n, dtype=torch.long, device=indices.device)
    )
    return (head * gc + grp) * k + indices.long()


def nearest(z: torch.Tensor, codebook: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Index of the nearest codeword for each group vector: z [N, H, n, G], codebook [Hc, nc, K, G] -> [N, H, n].

    Distance ||c||^2 - 2 z.c in fp32 (||z||^2 is common to all codewords; fp32 under autocast too, which
    would otherwise run the product in bf16); ties go to the lowest index. On CUDA one fused kernel
    (:mod:`~loopvq_calib.kernels.nearest`) where the kernels' dispatch takes it: the same distances up to the
    order of the fp32 sums, without the [H*n, N, K] distance block.
    """
    k, g = codebook.shape[-2:]
    fused = nearest_kernel.candidate(z.device, k, g)
    return DISPATCH.run(
        Backend.AUTO,
        [
            replace(fused, run=lambda: nearest_kernel.nearest(z, codebook)),
            Candidate(Backend.TORCH, "torch", run=lambda: _nearest_torch(z, codebook, chunk)),
        ],
        what="nearest codeword",
        choices=CODEC_CHOICES,
        device=z.device,
    )


def _nearest_torch(z: torch.Tensor, codebook: torch.Tensor, chunk: int) -> torch.Tensor:
    with torch.autocast(z.device.type, enabled=False):
        return _nearest_chunks(z, codebook, chunk)


def _nearest_chunks(z: torch.Tensor, codebook: torch.Tensor, chunk: int) -> torch.Tensor:
    n_tok, h, n = z.shape[:3]
    cb = codebook.detach().float().expand(h, n, -1, -1).reshape(h * n, *codebook.shape[2:])  # [HN, K, G]
    cb_sq = cb.pow(2).sum(-1)[:, None, :]  # [HN, 1, K]
    cb_t = (-2 * cb).transpose(1, 2)  # [HN, G, K]
    zt = z.detach().float().reshape(n_tok, h * n, -1).transpose(0, 1)  # [HN, N, G]
    out = [torch.baddbmm(cb_sq, part, cb_t).min(-1).indices for part in zt.split(chunk, dim=1)]
    if not out:
        return torch.zeros(0, h, n, dtype=torch.long, device=z.device)
    return torch.cat(out, dim=1).transpose(0, 1).reshape(n_tok, h, n).contiguous()


def lookup(indices: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Codewords for indices [N, H, n] -> [N, H, n, G]; differentiable w.r.t. ``codebook``."""
    rows = flat_codebook_index(indices, codebook)
    return codebook.reshape(-1, codebook.shape[-1]).index_select(0, rows.reshape(-1)).view(*indices.shape, -1)


class _FusedLookup(torch.autograd.Function):
    """:func:`~loopvq_calib.kernels.lookup.lookup_block` with the torch path's gradient: the block's gradient
    gathered into group order (``to_groups``) and added into the codebook rows of the codes."""

    @staticmethod
    def forward(
        ctx: Any,
        codebook: torch.Tensor,
        indices: torch.Tensor,
        to_block: torch.Tensor,  # type: ignore[override]
        to_groups: torch.Tensor,
        steps: int,
        head_dim: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(indices, to_groups)
        ctx.book_shape = codebook.shape
        return lookup_kernel.lookup_block(indices, codebook, to_block, steps=steps, head_dim=head_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        indices, to_groups = ctx.saved_tensors
        n_tok, g = indices.shape[0], ctx.book_shape[-1]
        grad_z = grad.reshape(n_tok, -1).gather(-1, to_groups.expand(n_tok, -1))  # group order [N, H*n*G]
        rows = flat_codebook_index(indices, torch.empty(ctx.book_shape, device="meta"))
        flat = grad.new_zeros(ctx.book_shape.numel() // g, g).index_add_(0, rows.reshape(-1), grad_z.view(-1, g))
        return flat.view(ctx.book_shape), None, None, None, None, None


def fused_lookup(
    codebook: torch.Tensor,
    indices: torch.Tensor,
    to_block: torch.Tensor,
    *,
    to_groups: torch.Tensor,
    steps: int,
    head_dim: int,
) -> torch.Tensor:
    """Codewords of ``indices`` [N, H, n] from ``codebook`` [Hc, nc, K, G] (fp32) placed in block order [N, steps,
    H, head_dim] by the fused kernel (:func:`~loopvq_calib.kernels.lookup.lookup_block`; ``to_block`` /
    ``to_groups``: :func:`block_permutation`), differentiable w.r.t. the codebook."""
    return _FusedLookup.apply(codebook, indices, to_block, to_groups, steps, head_dim)


@dataclass
class BlockCodec:
    """Encoder/decoder of one (kind, block): layout, codebook [Hc, nc, K, G] and optional TaSQ transform."""

    layout: BlockLayout
    codebook: torch.Tensor
    transform: TasqTransform | None = None
    _permutation: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def permutation(self, heads: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`block_permutation` of this layout for blocks [T, heads, head_dim] on ``device``, computed
        once per groups tensor."""
        groups, key = self.layout.groups, (heads, head_dim, device)
        kept = self._permutation.get(key)
        if kept is None or kept[0] is not groups:
            kept = (groups, *block_permutation(groups, self.layout.steps, heads, head_dim=head_dim, device=device))
            self._permutation[key] = kept
        return kept[1], kept[2]

    def encode(self, x: torch.Tensor) -> Codes:
        """x [N, T, H, D] -> indices of the nearest codewords (in the transformed space for TaSQ)."""
        sigma = None
        x = x.float()
        if self.transform is not None:
            sigma = self.transform.sigma(x)
            x = self.transform.forward(x, sigma)
        n, _, h, d = x.shape
        to_groups, _ = self.permutation(h, d, x.device)
        z = x.reshape(n, -1).gather(-1, to_groups.expand(n, -1)).view(n, h, *self.layout.groups.shape[1:])
        idx = nearest(z, self.codebook.float())
        return Codes(idx.to(index_dtype(self.codebook.shape[2])), sigma)

    def decode(self, codes: Codes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Codes -> [N, T, H, D] (gradients flow to the codebook)."""
        codebook, steps = self.codebook.to(dtype), self.layout.steps
        n, h, n_groups = codes.indices.shape
        d = n_groups * codebook.shape[-1] // steps
        to_groups, to_block = self.permutation(h, d, codebook.device)

        def in_torch() -> torch.Tensor:
            z = lookup(codes.indices, codebook)
            return z.reshape(n, -1).gather(-1, to_block.expand(n, -1)).view(n, steps, h, d)

        fused = lookup_kernel.candidate(codebook.device, codebook.dtype)
        y = DISPATCH.run(
            Backend.AUTO,
            [  # CUDA: one fused kernel, the same values
                replace(
                    fused,
                    run=lambda: fused_lookup(
                        codebook,
                        codes.indices.to(codebook.device),
                        to_block,
                        to_groups=to_groups,
                        steps=steps,
                        head_dim=d,
                    ),
                ),
                Candidate(Backend.TORCH, "torch", run=in_torch),
            ],
            what="codeword lookup",
            choices=CODEC_CHOICES,
            device=codebook.device,
        )
        if self.transform is not None:
            y = self.transform.inverse(y, codes.sigma)
        return y

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)); the assignment has no gradient, the lookup is exact."""
        return self.decode(
            self.encode(x), dtype=self.codebook.dtype if self.codebook.is_floating_point() else torch.float32
        )


def code_bits(codebook_size: int, group_size: int) -> float:
    """Index bits per element: log2(K) / G."""
    return math.log2(codebook_size) / group_size


def sigma_bits(kv_heads: int, head_dim: int) -> float:
    """TaSQ's fp16 sigma per token and site, spread over the site's H*D key elements."""
    return 16.0 / (kv_heads * head_dim)
