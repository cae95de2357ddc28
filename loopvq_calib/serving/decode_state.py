"""What a :class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` keeps for the decode-attention kernels: each
site's step tables, each (kind, block)'s coded pages in one growing buffer, the RoPE table, and the positions
read once per forward (:class:`KernelState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..codes.codec import Codes
from ..kernels.backends import Backend
from ..kernels.decode_inputs import CodedTokens, FullPrecisionTokens, StepTables
from .decode_attention import RopeTable, decode_attention, site_tables


class CodeBuffer:
    """One (kind, block)'s coded pages as a [B, capacity, ...] tensor that doubles when full, so the kernel
    reads tokens at a fixed stride; pages are copied in once, as the cache encodes them. Indices are stored
    head-major ([B, H, capacity, n], exposed as a [B, capacity, H, n] view): a kernel that streams one head's
    tokens reads contiguous bytes."""

    def __init__(self) -> None:
        self.indices: torch.Tensor | None = None
        self.sigma: torch.Tensor | None = None
        self.pages = 0
        self.count = 0

    def sync(self, pages: list[Codes], batch: int, page_size: int, *, chunk: int = 256) -> CodeBuffer:
        """Copy in the pages added since the last call (pages' rows are batch-major: b * page + token), up to
        ``chunk`` pages per copy; the capacity is the one page-by-page calls reach (grown once)."""
        new = pages[self.pages :]
        if new:
            first = new[0]
            cap = self.indices.shape[1] if self.indices is not None else 0
            grown = _capacity(cap, self.count, len(new), page_size=page_size)
            if grown != cap:
                idx = first.indices.view(batch, page_size, *first.indices.shape[1:])
                self.indices = _grown(self.indices, idx, grown, count=self.count, head_major=True)
                if first.sigma is not None:
                    self.sigma = _grown(self.sigma, first.sigma.view(batch, page_size, -1), grown, count=self.count)
            for i in range(0, len(new), chunk):
                part = new[i : i + chunk]
                n = page_size * len(part)
                self.indices[:, self.count : self.count + n] = _joined(
                    [c.indices.view(batch, page_size, *c.indices.shape[1:]) for c in part]
                )
                if first.sigma is not None:
                    self.sigma[:, self.count : self.count + n] = _joined(
                        [c.sigma.view(batch, page_size, -1) for c in part]
                    )
                self.count += n
        self.pages = len(pages)
        return self


def _capacity(capacity: int, count: int, pages: int, *, page_size: int) -> int:
    """Tokens a buffer holds after ``pages`` more pages, one at a time: max(2 * count, count + page, 64) whenever
    a page overflows it."""
    for _ in range(pages):
        if count + page_size > capacity:
            capacity = max(2 * count, count + page_size, 64)
        count += page_size
    return capacity


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` side by side along the token axis (dim 1), without a copy for one part."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _grown(
    old: torch.Tensor | None, like: torch.Tensor, capacity: int, *, count: int, head_major: bool = False
) -> torch.Tensor:
    """A [B, capacity, ...] tensor holding ``old``'s first ``count`` tokens; ``head_major``: [B, H, capacity, n]
    storage behind a [B, capacity, H, n] view."""
    if head_major:
        new = like.new_empty(like.shape[0], like.shape[2], capacity, like.shape[3]).transpose(1, 2)
    else:
        new = like.new_empty(like.shape[0], capacity, *like.shape[2:])
    if old is not None:
        new[:, :count] = old[:, :count]
    return new


@dataclass
class KernelState:
    """What a :class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` keeps for the kernel: the RoPE table, each
    site's step tables and each (kind, block)'s code buffer."""

    head_dim: int
    rope_theta: float
    tables: dict[int, StepTables] = field(default_factory=dict)
    buffers: dict[str, CodeBuffer] = field(default_factory=dict)
    rope: RopeTable | None = None
    _forward: Any = None  # the forward context whose positions were last read
    _largest: int = 0
    _tokens: tuple | None = None  # (ctx, coded count, coded first positions, fp positions, fp mask) of this forward

    def _max_position(self, ctx: Any) -> int:
        """Largest position so far: one device read per forward (not per site)."""
        if ctx is not self._forward:
            self._forward = ctx
            self._largest = max(self._largest, int(ctx.positions.max()))
        return self._largest

    def _token_positions(
        self, cache: Any, site: int, ctx: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The first coded position, the full-precision tokens' positions and their mask column, in the
        kernels' dtypes (int32, int32, int8): the same at every site of one forward (every site holds the same
        tokens), so built and converted once per forward."""
        if self._tokens is None or self._tokens[0] is not ctx or self._tokens[1] != cache.encoded:
            sinks, n, pos = cache._sinks, cache.encoded, cache.positions[site]
            fp_pos = torch.cat([pos[:, :sinks], pos[:, sinks + n :]], 1).to(torch.int32)
            fp_mask = None
            if ctx.mask is not None:
                m = ctx.mask[:, 0, -1]
                fp_mask = torch.cat([m[:, :sinks], m[:, sinks + n :]], 1).to(torch.int8)
            first = (pos[:, sinks] if n else pos[:, 0]).to(torch.int32)
            self._tokens = (ctx, n, first, fp_pos, fp_mask)
        return self._tokens[2:]

    def attend(self, cache: Any, site: int, q: torch.Tensor, *, ctx: Any, backend: Backend) -> torch.Tensor:
        """Attention of q [B, Hq, D] (post-RoPE) over the cache's tokens at ``site`` (the new token appended),
        through ``backend``'s decode kernel (``auto``: the decode dispatch's choice)."""
        if self.rope is None:
            self.rope = RopeTable(self.head_dim, self.rope_theta)
        names = cache.codec_of[site]
        if site not in self.tables:
            self.tables[site] = site_tables(cache.quantizer.codecs, names, site, q, rope_style=ctx.rope_style)
        n, bsz = cache.encoded, q.shape[0]
        first, fp_pos, fp_mask = self._token_positions(cache, site, ctx)
        if n:
            kb, vb = (self.buffers.setdefault(names[kind], CodeBuffer()) for kind in ("key", "value"))
            for buffer, kind in ((kb, "key"), (vb, "value")):
                buffer.sync(cache.codes[names[kind]], bsz, cache.page_size)
            coded = CodedTokens(kb.indices, vb.indices, kb.sigma, n, first)
        else:
            empty = torch.zeros(bsz, 1, 1, 1, dtype=torch.uint8, device=q.device)
            coded = CodedTokens(empty, empty, None, 0, first)
        fp = FullPrecisionTokens(cache.keys[site], cache.values[site], fp_pos, fp_mask)
        return decode_attention(
            q, self.tables[site], coded, fp=fp, rope=self.rope, max_position=self._max_position(ctx), backend=backend
        )
