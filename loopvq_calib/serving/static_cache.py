"""The quantized cache in buffers of fixed size: decode steps that a CUDA graph can capture and replay.

:class:`StaticQuantizedLoopKVCache` holds what a :class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` holds
after its prefill, laid out once for a batch and a maximum length, so that a decode step (one new token per
sequence) allocates no state and takes no host decision that depends on the tokens so far:

    columns [0, S)        sinks (S = sink_tokens + the prefill's largest left padding), pre-RoPE, model dtype
    columns [S, S + W)    the window as a ring of W = recent_window + page_size slots, pre-RoPE, model dtype
    coded slots           per (kind, block): indices [B, capacity, H, n] (head-major) and TaSQ sigma [B, capacity, T]

Token t >= S sits in column S + (t - S) % W until it is encoded; pages are encoded oldest first, so the window
(at most W tokens) never overwrites a live token. Every column has a position and a mask entry (0: empty,
encoded or left padding). The kernels attend over every column and the coded slots, with launches planned for
the capacity and the coded count read on the device (``CodedTokens.live``). A step changes device tensors only:
the new token's column (from the token counter), its keys and values at every site, the counters, and, on the
steps that encode a page (every ``page_size`` steps, after the forward's last site, as the eager cache does),
the page's codes and mask. The host keeps mirrors of the two counters (it knows them without reading the device)
to say which steps encode; :class:`~loopvq_calib.serving.graph_decode.GraphDecoder` captures one graph of each
kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..codes.codec import BlockCodec, Codes, index_dtype
from ..codes.quantizer import KVQuantizer
from ..kernels.backends import Backend
from ..kernels.decode_inputs import CodedTokens, FullPrecisionTokens, StepTables
from ..models.common import sdpa
from ..runtime.devices import indexed_device
from .cache import QuantizedLoopKVCache, left_padding
from .decode_attention import RopeTable, decode_attention, site_tables


@dataclass
class CodeSlots:
    """One (kind, block)'s coded tokens: ``indices`` [B, capacity, H, n] (stored head-major, as the kernels read
    them) and TaSQ's ``sigma`` [B, capacity, T] float16, or None."""

    indices: torch.Tensor
    sigma: torch.Tensor | None

    @classmethod
    def empty(cls, codec: BlockCodec, batch: int, *, capacity: int, device: torch.device) -> CodeSlots:
        lay = codec.layout
        dtype = index_dtype(codec.codebook.shape[2])
        indices = torch.zeros(batch, lay.kv_heads, capacity, lay.num_groups, dtype=dtype, device=device).transpose(1, 2)
        sigma = None
        if codec.transform is not None:
            sigma = torch.zeros(batch, capacity, lay.steps, dtype=torch.float16, device=device)
        return cls(indices, sigma)


class StaticQuantizedLoopKVCache:
    """A quantized KV cache of fixed capacity for decode steps (module docstring); made from a prefilled
    :class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` by :meth:`from_cache`. ``backend`` as the eager
    cache's: on CUDA the decode kernels, elsewhere (or ``"torch"``) :meth:`reference_attention`."""

    def __init__(
        self,
        quantizer: KVQuantizer,
        sink_tokens: int,
        recent_window: int,
        *,
        page_size: int = 8,
        backend: Backend | str = Backend.AUTO,
        batch: int,
        max_length: int,
        sink_columns: int | None = None,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if not isinstance(quantizer, KVQuantizer):
            raise ValueError(f"a static cache serves LoopVQ codes; {type(quantizer).__name__} has none")
        # the eager cache's checks, codec map, loop count and kernel choice; it holds no tokens
        self.rules = QuantizedLoopKVCache(quantizer, sink_tokens, recent_window, page_size=page_size, backend=backend)
        self.quantizer, self.device, self.dtype = quantizer, indexed_device(device), dtype
        _check_device(quantizer, self.device)
        self.sinks = sink_tokens if sink_columns is None else sink_columns
        if self.sinks < sink_tokens or max_length < 1 or batch < 1:
            raise ValueError(
                f"need sink_columns >= sink_tokens, max_length >= 1, batch >= 1; got {self.sinks}, "
                f"{max_length}, {batch}"
            )
        self.batch, self.max_length, self.page_size, self.recent_window = batch, max_length, page_size, recent_window
        self.ring = recent_window + page_size
        self.capacity = max(-(-(max_length - self.sinks - recent_window) // page_size), 1) * page_size
        kv, on = quantizer.kv, dict(device=self.device)
        shape = (batch, self.sinks + self.ring, kv.kv_heads, kv.head_dim)
        self.keys = {s.site: torch.zeros(shape, dtype=dtype, **on) for s in kv.sites}
        self.values = {s.site: torch.zeros(shape, dtype=dtype, **on) for s in kv.sites}
        self.fp_positions = torch.zeros(shape[:2], dtype=torch.int32, **on)
        self.fp_mask = torch.zeros(shape[:2], dtype=torch.int8, **on)  # 1: attend
        self.first_position = torch.zeros(batch, dtype=torch.int32, **on)  # of each row's first coded token
        self.codes = {
            name: CodeSlots.empty(codec, batch, capacity=self.capacity, device=self.device)
            for name, codec in quantizer.codecs.items()
        }
        self.coded = torch.zeros(1, dtype=torch.int32, **on)  # coded tokens, on the device
        self.tokens = torch.zeros(1, dtype=torch.long, **on)  # tokens held, on the device
        self._column = torch.zeros(1, dtype=torch.long, **on)  # this forward's column
        self._page = torch.arange(page_size, **on)
        self._slots = torch.arange(self.capacity, **on)
        self._route: tuple[Backend | None] | None = None  # the decode kernel's backend (None: reference), chosen once
        self.length = 0  # the host's mirrors of ``tokens`` and ``coded``
        self.encoded = 0
        self.first_site = min(s.site for s in kv.sites)
        self.tables: dict[int, StepTables] = {}
        self.rope: RopeTable | None = None
        self.served_by_kernel = False
        self._forced: bool | None = None  # the page decision while a step is captured
        self._due = False

    @classmethod
    def from_cache(cls, cache: QuantizedLoopKVCache, *, max_length: int) -> StaticQuantizedLoopKVCache:
        """A static cache holding the tokens of ``cache`` (prefilled, ``store="indices"``; left unchanged) with room
        for ``max_length`` tokens in all, on the device and in the dtype of its keys."""
        if cache.store != "indices" or not cache.keys:
            raise ValueError("from_cache needs a prefilled QuantizedLoopKVCache with store='indices'")
        if cache.get_seq_length() > max_length:
            raise ValueError(f"the cache holds {cache.get_seq_length()} tokens, more than max_length {max_length}")
        ref = cache.keys[min(cache.keys)]
        static = cls(
            cache.quantizer,
            cache.sink_tokens,
            cache.recent_window,
            page_size=cache.page_size,
            backend=cache.backend,
            batch=ref.shape[0],
            max_length=max_length,
            sink_columns=cache.sink_columns,
            dtype=ref.dtype,
            device=ref.device,
        )
        static._load(cache)
        return static

    def _load(self, cache: QuantizedLoopKVCache) -> None:
        """Copy ``cache``'s sinks and window into their columns, its pages into the coded slots, and set the
        positions, the mask (left padding, the eager rule: position 0 before the first real token) and counters."""
        length, encoded, s, b = cache.get_seq_length(), cache.encoded, self.sinks, self.batch
        held = [*range(min(length, s)), *range(s + encoded, length)]
        columns = torch.tensor([t if t < s else s + (t - s) % self.ring for t in held], device=self.device)
        for site in self.keys:
            self.keys[site].index_copy_(1, columns, cache.keys[site])
            self.values[site].index_copy_(1, columns, cache.values[site])
        pos = cache.positions[min(cache.positions)]
        tokens = torch.tensor(held, device=self.device)
        self.fp_positions.index_copy_(1, columns, pos.index_select(1, tokens).to(torch.int32))
        padding = left_padding(pos)
        self.fp_mask.index_copy_(1, columns, (tokens[None] >= padding[:, None]).to(torch.int8))
        self.first_position.copy_(pos[:, -1] - (length - 1 - s))  # real tokens' positions are consecutive
        for name, pages in cache.codes.items():
            slots = self.codes[name]
            if not pages:
                continue
            slots.indices[:, :encoded] = torch.cat(
                [c.indices.view(b, self.page_size, *c.indices.shape[1:]) for c in pages], 1
            )
            if slots.sigma is not None:
                slots.sigma[:, :encoded] = torch.cat([c.sigma.view(b, self.page_size, -1) for c in pages], 1)
        self.coded.fill_(encoded)
        self.tokens.fill_(length)
        self.length, self.encoded = length, encoded

    # -- the cache protocol ------------------------------------------------------------------------
    def attend(self, site: int, q: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor, ctx: Any) -> torch.Tensor:
        """One decode step at ``site``: the new token's pre-RoPE ``key`` / ``value`` [B, 1, H, D] written into its
        column, then the attention of ``q`` [B, 1, Hq, D] (post-RoPE) over every token, through the kernels'
        dispatch (the cache's backend) or :meth:`reference_attention`; after the forward's last site the oldest
        window page is encoded when one is due. Returns [B, 1, Hq * D]."""
        if q.shape[1] != 1:
            raise ValueError("a static cache takes one new token per sequence and step")
        if site == self.first_site:
            self._begin(ctx.positions)
        self.keys[site].index_copy_(1, self._column, key)
        self.values[site].index_copy_(1, self._column, value)
        if self._route is None:  # the device and the query's shape are the cache's for its whole life
            self._route = (self.rules.decode_backend(q),)
        backend = self._route[0]
        if backend is None:
            out = self.reference_attention(site, q, rope=ctx.rope)
        else:
            out = self._kernel_attention(site, q[:, 0], ctx=ctx, backend=backend)
        if site == self.rules.last_site:
            self._end()
        return out.reshape(q.shape[0], 1, -1)

    def update(
        self,
        site: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        positions: torch.Tensor,
        rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill is not served here: prefill a :class:`QuantizedLoopKVCache`, then :meth:`from_cache`."""
        raise ValueError(
            "a static cache serves decode steps only: prefill a QuantizedLoopKVCache, then "
            "StaticQuantizedLoopKVCache.from_cache(cache, max_length=...)"
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def check_steps(self, num_steps: int) -> None:
        """The quantizer's loop count, fixed for the cache's life (as the eager cache)."""
        self.rules.check_steps(num_steps)

    def regions(self) -> dict[str, int]:
        """Token counts per region (sinks with left padding, encoded, window), from the host's mirrors."""
        return {
            "sink": min(self.length, self.sinks),
            "encoded": self.encoded,
            "window": max(self.length - self.sinks - self.encoded, 0),
        }

    def nbytes(self) -> int:
        """Bytes of the K/V payload buffers: full-precision columns, coded slots (indices and sigma), at capacity."""
        tensors = [
            *self.keys.values(),
            *self.values.values(),
            *(t for c in self.codes.values() for t in (c.indices, c.sigma) if t is not None),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- steps ---------------------------------------------------------------------------------------
    def page_due(self) -> bool:
        """Whether the next step encodes a page (its window then reaches recent_window + page_size tokens);
        ValueError when the cache is full."""
        if self.length >= self.max_length:
            raise ValueError(f"the static cache is full: it was made for max_length {self.max_length} tokens")
        if self._forced is not None:
            return self._forced
        return self.length + 1 - self.sinks - self.encoded >= self.recent_window + self.page_size

    def next_positions(self) -> torch.Tensor:
        """The position of each row's next token, [B, 1] int64 (the newest position held, plus one)."""
        return self.fp_positions.max(1, keepdim=True).values.long() + 1

    @contextmanager
    def capturing(self, *, encode: bool) -> Iterator[None]:
        """While a step is captured (its Python runs, the device does nothing): the page decision fixed to
        ``encode``, and the host's mirrors left as they were."""
        held = (self.length, self.encoded)
        self._forced = encode
        try:
            yield
        finally:
            self._forced = None
            self.length, self.encoded = held

    def replayed(self, *, encode: bool) -> None:
        """Advance the host's mirrors by a step replayed from a graph (``encode``: it encoded a page)."""
        self.length += 1
        self.encoded += self.page_size if encode else 0

    def _begin(self, positions: torch.Tensor) -> None:
        """At the forward's first site: the new token's column, position and mask entry."""
        self._due = self.page_due()
        t, s = self.tokens, self.sinks
        self._column.copy_(torch.where(t < s, t, (t - s).remainder(self.ring) + s))
        self.fp_positions.index_copy_(1, self._column, positions.to(torch.int32))
        self.fp_mask.index_fill_(1, self._column, 1)

    def _end(self) -> None:
        """After the forward's last site: count the token, encode the oldest window page when due."""
        self.tokens.add_(1)
        if self._due:
            self._encode_page()
        self.length += 1
        self.encoded += self.page_size if self._due else 0

    def _encode_page(self) -> None:
        """Encode the oldest window page of every block (all its steps at once) into the next coded slots, and
        take its columns out of the full-precision tokens."""
        slots = self.coded.long() + self._page
        columns = slots.remainder(self.ring) + self.sinks  # coded token c was token sinks + c
        b, p = self.batch, self.page_size
        for name, codec in self.quantizer.codecs.items():
            store = self.keys if codec.layout.kind == "key" else self.values
            x = torch.stack([store[site].index_select(1, columns) for site in codec.layout.sites], dim=2)
            codes = codec.encode(x.flatten(0, 1))  # rows b * page + token, as the eager cache's pages
            target = self.codes[name]
            target.indices.index_copy_(1, slots, codes.indices.view(b, p, *codes.indices.shape[1:]))
            if target.sigma is not None:
                target.sigma.index_copy_(1, slots, codes.sigma.view(b, p, -1))
        self.fp_mask.index_fill_(1, columns, 0)
        self.coded.add_(p)

    # -- attention -----------------------------------------------------------------------------------
    def _kernel_attention(self, site: int, q: torch.Tensor, *, ctx: Any, backend: Backend) -> torch.Tensor:
        """Attention of q [B, Hq, D] through decode attention's dispatch: launches planned for the capacity, the
        coded count read on the device, every full-precision column under the mask."""
        names = self.rules.codec_of[site]
        if site not in self.tables:
            self.tables[site] = site_tables(self.quantizer.codecs, names, site, q, rope_style=ctx.rope_style)
        if self.rope is None:
            self.rope = RopeTable(self.quantizer.kv.head_dim, ctx.rope_theta)
        ks, vs = self.codes[names["key"]], self.codes[names["value"]]
        coded = CodedTokens(ks.indices, vs.indices, ks.sigma, self.capacity, self.first_position, live=self.coded)
        fp = FullPrecisionTokens(self.keys[site], self.values[site], self.fp_positions, self.fp_mask)
        self.served_by_kernel = True
        return decode_attention(
            q, self.tables[site], coded, fp=fp, rope=self.rope, max_position=self.max_length, backend=backend
        )

    def reference_attention(
        self, site: int, q: torch.Tensor, *, rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """The same attention in PyTorch, at the same fixed shapes: every coded slot decoded (the eager cache's
        arithmetic), keys rotated by ``rope`` at their positions, SDPA under the mask of live slots and columns.
        q [B, 1, Hq, D] post-RoPE; returns [B, 1, Hq * D]."""
        names, b, cap = self.rules.codec_of[site], self.batch, self.capacity
        decoded = []
        for kind in ("key", "value"):
            codec, slots = self.quantizer.codecs[names[kind]], self.codes[names[kind]]
            codes = Codes(
                slots.indices.reshape(b * cap, *slots.indices.shape[2:]),
                None if slots.sigma is None else slots.sigma.reshape(b * cap, -1),
            )
            x = codec.decode(codes)[:, codec.layout.sites.index(site)]
            decoded.append(x.reshape(b, cap, *x.shape[1:]).to(self.dtype))
        slot = self._slots
        keys = torch.cat(
            [
                rope(decoded[0], self.first_position[:, None].long() + slot),
                rope(self.keys[site], self.fp_positions.long()),
            ],
            1,
        )
        values = torch.cat([decoded[1], self.values[site]], 1)
        mask = torch.cat([(slot < self.coded)[None].expand(b, -1), self.fp_mask.bool()], 1)
        return sdpa(q, keys, values, mask=mask[:, None, None, :])


def _check_device(quantizer: KVQuantizer, device: torch.device) -> None:
    """Codebooks and TaSQ weights on the cache's device: a step that copies them there cannot be captured."""
    for name, codec in quantizer.codecs.items():
        tensors = [codec.codebook] + ([codec.transform.weight] if codec.transform is not None else [])
        if any(indexed_device(t.device) != device for t in tensors):
            raise ValueError(
                f"codec {name} is on {codec.codebook.device}, the cache on {device}: move the quantizer "
                "first (quantizer.to(device))"
            )
