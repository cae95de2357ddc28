"""Uncalibrated KV-cache baselines served through the same cache as LoopVQ codes.

Each baseline is a :class:`BaselineQuantizer`: a set of codecs with the interface the quantized cache and
the KL evaluation use (``layout.kind``, ``layout.sites``, ``encode(x [N, T, H, D]) -> codes``,
``decode(codes) -> [N, T, H, D]``, ``quantize``), so they are evaluated exactly like a bundle:

- ``last-step-kv``: keep only the last loop step's keys and values of each layer and let every loop step
  read them (Ouro's KV sharing for decoding); prelude/coda sites of Huginn are kept as they are.
- ``kivi2`` / ``kivi4``: KIVI (arXiv:2402.02750) asymmetric 2/4-bit integers, keys per channel over groups of
  ``group`` tokens (one page), values per token over groups of ``group`` channels; fp16 scale and minimum.
- ``fp8``: keys and values cast to float8 e4m3 (saturating at +-448), no scale.

The codes hold the tensors a server would store (bit-packed integers, fp16 scales, float8 bytes), so
the cache's byte count is their actual storage.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch

from ..models.sites import KVLayout

BASELINES = ("last-step-kv", "kivi2", "kivi4", "fp8")
KIVI_GROUP = 32
FP8_MAX = 448.0


@dataclass
class SiteSpan:
    """The sites one baseline codec covers (in loop-step order) and whether they hold keys or values."""

    kind: str
    sites: tuple[int, ...]

    @property
    def steps(self) -> int:
        """Sites covered."""
        return len(self.sites)


@dataclass
class StoredCodes:
    """What a baseline stores for encoded tokens; every tensor's first dim is batch-major (rows of one
    batch element together), so beam reordering and byte counting work field by field."""

    data: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        """The stored tensors (the fields that are set)."""
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def select(self, beam_idx: torch.Tensor) -> StoredCodes:
        """Reorder the batch: each tensor's rows are split evenly over the batch elements."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            idx = beam_idx.to(t.device)
            return t.view(len(idx), -1, *t.shape[1:]).index_select(0, idx).flatten(0, 1)

        return StoredCodes(*(pick(t) if t is not None else None for t in (self.data, self.scale, self.zero)))


# -- bit packing ---------------------------------------------------------------------------------------
def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2^bits) along the last dim -> uint8 holding 8/bits of them per byte."""
    per = 8 // bits
    q = q.to(torch.uint8).view(*q.shape[:-1], q.shape[-1] // per, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.uint8) * bits
    return (q << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` -> uint8 [..., last * 8/bits]."""
    per = 8 // bits
    shifts = torch.arange(per, device=p.device, dtype=torch.uint8) * bits
    return ((p[..., None] >> shifts) & (2**bits - 1)).flatten(-2)


# -- codecs --------------------------------------------------------------------------------------------
class _Codec:
    """What every baseline codec shares: its sites and quantize = decode(encode(.))."""

    def __init__(self, layout: SiteSpan) -> None:
        self.layout = layout

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) in ``x``'s dtype."""
        return self.decode(self.encode(x), dtype=x.dtype)


class LastStepCodec(_Codec):
    """Stores the last step's slice of a layer's block; every step decodes to it."""

    def encode(self, x: torch.Tensor) -> StoredCodes:
        return StoredCodes(x[:, -1].contiguous())

    def decode(self, codes: StoredCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return codes.data[:, None].expand(-1, self.layout.steps, -1, -1).to(dtype)


class Fp8Codec(_Codec):
    """float8 e4m3 values, saturating at +-FP8_MAX."""

    def encode(self, x: torch.Tensor) -> StoredCodes:
        return StoredCodes(x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))

    def decode(self, codes: StoredCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return codes.data.to(dtype)


class KiviCodec(_Codec):
    """Asymmetric ``bits``-bit integers: keys per channel over ``group`` consecutive rows (tokens), values
    per token over ``group`` consecutive channels (the channel count must be a multiple of ``group``)."""

    def __init__(self, layout: SiteSpan, bits: int, group: int) -> None:
        super().__init__(layout)
        self.bits, self.group = bits, group

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, H, D] -> groups along the last dim: keys [ceil(N/g), T, H, D, g'], values [N, T, H, D/g, g]."""
        if self.layout.kind == "value":
            return x.unflatten(-1, (-1, self.group))
        n, g = x.shape[0], self.group
        if n % g:  # a last, shorter token group (only outside the cache, whose pages are whole groups)
            full = x[: n - n % g].unflatten(0, (-1, g)).movedim(1, -1)
            return [full, x[n - n % g :][None].movedim(1, -1)]
        return x.unflatten(0, (-1, g)).movedim(1, -1)

    def encode(self, x: torch.Tensor) -> StoredCodes:
        parts = self._grouped(x.float())
        parts = parts if isinstance(parts, list) else [parts]
        q, scale, zero = [], [], []
        for z in parts:
            lo, hi = z.amin(-1), z.amax(-1)
            s = ((hi - lo) / (2**self.bits - 1)).to(torch.float16)
            lo16 = lo.to(torch.float16)
            s32 = s.float().clamp_min(torch.finfo(torch.float16).tiny)
            codes = ((z - lo16.float()[..., None]) / s32[..., None]).round().clamp(0, 2**self.bits - 1)
            if self.layout.kind == "key":
                codes = codes.movedim(-1, 1).flatten(0, 1)  # back to token rows [N, T, H, D]
            else:
                codes = codes.flatten(-2)
            q.append(codes)
            scale.append(s)
            zero.append(lo16)
        return StoredCodes(pack_bits(torch.cat(q), self.bits), torch.cat(scale), torch.cat(zero))

    def decode(self, codes: StoredCodes, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = unpack_bits(codes.data, self.bits).float()  # [N, T, H, D]
        s, lo = codes.scale.float(), codes.zero.float()
        if self.layout.kind == "value":
            y = q.unflatten(-1, (-1, self.group)) * s[..., None] + lo[..., None]
            return y.flatten(-2).to(dtype)
        rows = torch.arange(q.shape[0], device=q.device) // self.group  # token group of each row
        return (q * s[rows] + lo[rows]).to(dtype)


# -- the quantizer-like container ------------------------------------------------------------------------
@dataclass
class BaselineQuantizer:
    """Codecs of one baseline over every KV site, with the members evaluation and the cache read."""

    codecs: dict[str, Any]
    method: str
    kv: KVLayout
    page_size: int  # tokens encoded together in the served cache (KIVI: the key token group)
    bits_per_element: dict[str, float]
    codebook_size: int | None = None
    group_size: int | None = None
    steps_per_block: int = 1
    sharing: str = "none"
    fused_decode: ClassVar[bool] = False  # the fused decode kernels read calibrated codes only

    def quantize_sites(
        self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], dtype: torch.dtype | None = None
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """decode(encode(.)) of every site's keys/values [B, S, H, D] (batch rows one after another).
        ``dtype``: cast each block's result to it once, as ``KVQuantizer.quantize_sites`` does."""
        out: dict[str, dict[int, torch.Tensor]] = {"key": {}, "value": {}}
        src = {"key": keys, "value": values}
        for codec in self.codecs.values():
            lay = codec.layout
            first = src[lay.kind][lay.sites[0]]
            parts = []
            for b in range(first.shape[0]):  # token groups never straddle two sequences
                x = torch.stack([src[lay.kind][site][b] for site in lay.sites], dim=1)  # [S, T, H, D]
                parts.append(codec.quantize(x))
            y = torch.stack(parts)  # [B, S, T, H, D]
            if dtype is not None:
                y = y.to(dtype)
            for m, site in enumerate(lay.sites):
                out[lay.kind][site] = y[:, :, m]
        return out["key"], out["value"]

    def bits(self) -> dict[str, float]:
        """Stored bits per element of keys and values."""
        return dict(self.bits_per_element)

    def codebook_bytes(self, bytes_per_value: int = 2) -> int:
        """0: a baseline has no codebooks."""
        return 0

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> BaselineQuantizer:
        """Nothing to move (no tensors); returns self."""
        return self


def make_baseline(name: str, kv: KVLayout, group: int = KIVI_GROUP) -> BaselineQuantizer:
    """The baseline ``name`` (one of :data:`BASELINES`) for the KV layout ``kv``."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; expected one of {', '.join(BASELINES)}")
    codecs: dict[str, Any] = {}
    page = 8
    if name == "last-step-kv":
        looped = [s for s in kv.sites if s.looped]
        layers = sorted({s.layer for s in looped})
        for kind in ("key", "value"):
            for layer in layers:
                sites = tuple(s.site for s in sorted(looped, key=lambda s: s.step) if s.layer == layer)
                codecs[f"{kind}.l{layer}"] = LastStepCodec(SiteSpan(kind, sites))
            for s in kv.sites:
                if not s.looped:
                    codecs[f"{kind}.{s.stage}.l{s.layer}"] = LastStepCodec(SiteSpan(kind, (s.site,)))
        stored = sum(1 for s in kv.sites if not s.looped) + len(layers)
        bits = 16.0 * stored / kv.num_sites
        return BaselineQuantizer(codecs, name, kv, page, {"key": bits, "value": bits}, steps_per_block=kv.loop_steps)
    for kind in ("key", "value"):
        for s in kv.sites:
            span = SiteSpan(kind, (s.site,))
            if name == "fp8":
                codecs[f"{kind}.s{s.site}"] = Fp8Codec(span)
            else:
                if kv.head_dim % group:
                    raise ValueError(f"{name}: head_dim {kv.head_dim} is not a multiple of the group size {group}")
                codecs[f"{kind}.s{s.site}"] = KiviCodec(span, int(name[-1]), group)
    if name == "fp8":
        return BaselineQuantizer(codecs, name, kv, page, {"key": 8.0, "value": 8.0})
    b = int(name[-1])
    extra = 2 * 16 / group  # fp16 scale and minimum per group of `group` elements
    return BaselineQuantizer(codecs, name, kv, group, {"key": b + extra, "value": b + extra}, group_size=group)
