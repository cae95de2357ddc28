"""Building blocks shared by the native Ouro and Huginn models.

Everything that touches keys goes through :class:`ForwardContext`: it carries the positions, the RoPE
tables, the attention mask, the KV cache and the optional KV hook (see ``sites.py``), so that the same
physical attention module can be called once per loop step with a different site id.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

RopeStyle = str  # "half" (rotate_half / NeoX, Ouro) or "interleaved" (GPT-J pairs, Huginn)


class RMSNorm(nn.Module):
    """RMSNorm as in both reference implementations: fp32 statistics, cast back, then scale.

    On CUDA the normalisation is torch's fused ``rms_norm`` kernel (one kernel forward and one backward
    instead of seven elementwise ones each way, fp32 inside as here); it differs from the unfused form only
    in the order of the fp32 sum of squares. Elsewhere (CPU) it is the unfused reference form, bit for bit."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda:  # fp32 statistics and product inside the kernel, rounded once to x's dtype
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps).to(dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """inv_freq_i = theta^(-2i/D), i in [0, D/2), in fp32 (computed on the CPU, as the hub code does)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


@functools.lru_cache(maxsize=32)
def _inv_freq_on(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """:func:`rope_inv_freq` moved to ``device`` once: a host-to-device copy per call would make the
    host wait for the GPU at every KV site."""
    return rope_inv_freq(head_dim, theta).to(device)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * inv_freq, fp32, shape [*positions.shape, D/2]."""
    inv = _inv_freq_on(head_dim, float(theta), positions.device)
    with torch.autocast(device_type=positions.device.type, enabled=False):
        ang = positions.float()[..., None] * inv
    return ang.cos(), ang.sin()


def rope_factors(
    cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle, *, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`rotate` multiplies by, from ``cos``/``sin`` [B, S, D/2]: [B, S, 1, D], in ``dtype`` for
    ``half`` (cos twice, and -sin then sin: the sign of rotate_half folded in), fp32 for ``interleaved``
    (each cos twice, and -sin, sin per pair)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if style == "half":
        return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)
    if style == "interleaved":
        return torch.stack([cos, cos], -1).flatten(-2), torch.stack([-sin, sin], -1).flatten(-2)
    raise ValueError(f"unknown RoPE style {style!r}; expected 'half' or 'interleaved'")


def rotate(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor], style: RopeStyle) -> torch.Tensor:
    """Apply RoPE to ``x`` [B, S, H, D] with :func:`rope_factors`."""
    c, s = factors
    if style == "half":  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) = roll(x) * (-1, 1), exactly
        return x * c + x.roll(x.shape[-1] // 2, -1) * s
    # pair (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin) in fp32: x * (cos, cos) + (x1, x0) * (-sin, sin), exactly
    xf = x.float()
    return (xf * c + xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * s).to(x.dtype)


def pair_channels(head_dim: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Channels (a, b) of every RoPE pair: ``half`` (i, i + D/2), ``interleaved`` (2i, 2i + 1)."""
    i = torch.arange(head_dim // 2)
    if style == "half":
        return i, i + head_dim // 2
    if style == "interleaved":
        return 2 * i, 2 * i + 1
    raise ValueError(f"unknown RoPE style {style!r}; expected 'half' or 'interleaved'")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, style: RopeStyle) -> torch.Tensor:
    """Rotate ``x`` [B, S, H, D] with per-position angles ``cos``/``sin`` [B, S, D/2] (fp32).

    ``half``: channel i rotates with channel i + D/2 (Ouro, computed in the activation dtype).
    ``interleaved``: channels (2i, 2i+1) form one pair (Huginn, computed in fp32, cast back).
    """
    return rotate(x, rope_factors(cos, sin, style, dtype=x.dtype), style)


class KVHook(Protocol):
    """Called at every KV site with the pre-RoPE key and the value, [B, S, H_kv, D] each.

    Returns the key and value the attention goes on with (the same tensors to observe, others to
    substitute). ``positions`` [B, S] are the absolute token positions.
    """

    def __call__(
        self, site: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class KVStore(Protocol):
    """What attention needs from a KV cache: append this call's keys/values and return the whole site."""

    def update(
        self,
        site: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        positions: torch.Tensor,
        rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


@dataclass
class ForwardContext:
    """Per-forward state shared by every attention call."""

    positions: torch.Tensor  # [B, S] absolute positions of the query tokens
    mask: torch.Tensor | None  # [B, 1, S, P+S] bool (True = attend) or None for plain causal
    rope_style: RopeStyle
    rope_theta: float
    cache: KVStore | None = None
    hook: KVHook | None = None
    query_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
    _rope: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (head_dim, dtype) -> factors

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE at ``positions``; the factors at this forward's own positions are computed once and
        shared by every site (every loop step and layer rotates at the same positions)."""
        if positions is not self.positions:
            cos, sin = rope_angles(positions, x.shape[-1], self.rope_theta)
            return apply_rope(x, cos, sin, style=self.rope_style)
        key = (x.shape[-1], x.dtype)
        if key not in self._rope:
            cos, sin = rope_angles(positions, x.shape[-1], self.rope_theta)
            self._rope[key] = rope_factors(cos, sin, self.rope_style, dtype=x.dtype)
        return rotate(x, self._rope[key], self.rope_style)


def attend(ctx: ForwardContext, site: int, q: torch.Tensor, *, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention at one KV site. q [B,S,Hq,D], k/v pre-RoPE [B,S,Hkv,D]; returns [B,S,Hq*D]."""
    if ctx.query_observer is not None:
        ctx.query_observer(site, q, ctx.positions)
    if ctx.hook is not None:
        k, v = ctx.hook(site, k, v, ctx.positions)
    q = ctx.rope(q, ctx.positions)
    if ctx.cache is not None and q.shape[1] == 1 and hasattr(ctx.cache, "attend"):
        # a cache with its own decode attention; None: not this call
        out = ctx.cache.attend(site, q, key=k, value=v, ctx=ctx)
        if out is not None:
            return out
    if ctx.cache is not None:
        k, v = ctx.cache.update(site, k, v, positions=ctx.positions, rope=ctx.rope)
    else:
        k = ctx.rope(k, ctx.positions)
    return sdpa(q, k, v, mask=ctx.mask)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: torch.Tensor | None) -> torch.Tensor:
    """The attention of :func:`attend` once keys are rotated: q [B,S,Hq,D], k/v post-RoPE [B,P+S,Hkv,D] (GQA:
    KV heads repeated), ``mask`` [B,1,S,P+S] bool or None (causal); returns [B,S,Hq*D]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


def build_context(
    input_len: int,
    batch: int,
    device: torch.device,
    *,
    rope_style: RopeStyle,
    rope_theta: float,
    cache: KVStore | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    hook: KVHook | None,
    query_observer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
) -> ForwardContext:
    """Positions and mask from explicit ``past_len + q_len`` (never from a cache's internals).

    ``attention_mask`` is the usual 2-D padding mask over all tokens so far ([B, past+S], 1 = real token).
    """
    past = cache.get_seq_length() if cache is not None else 0
    total = past + input_len
    if attention_mask is not None and attention_mask.shape[-1] != total:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} tokens but the cache holds {past} "
            f"and the input {input_len} (expected {total})"
        )
    if position_ids is None:
        if attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        else:
            position_ids = torch.arange(past, total, device=device)[None]
    position_ids = position_ids.expand(batch, input_len)
    mask = None
    if attention_mask is not None or (past and input_len > 1):
        q_idx = torch.arange(past, total, device=device)[:, None]
        k_idx = torch.arange(total, device=device)[None, :]
        mask = (k_idx <= q_idx)[None, None].expand(batch, 1, input_len, total)
        if attention_mask is not None:
            # a padded query may see no key at all (NaN in softmax, and NaN * 0 still leaks into real
            # tokens through V): let every query see itself; padded outputs are never read.
            mask = (mask & attention_mask.bool()[:, None, None, :]) | (k_idx == q_idx)[None, None]
    return ForwardContext(position_ids, mask, rope_style, rope_theta, cache, hook, query_observer)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with separate gate/up projections (Ouro / Qwen2 naming)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def pick(kwargs: dict[str, Any], *names: str) -> Any:
    """First non-None keyword among ``names`` (transformers renamed ``past_key_values`` to ``cache``)."""
    for name in names:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None
