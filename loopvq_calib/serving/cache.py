"""Reference quantized KV cache: the serving contract of docs/method.md section 9, written for clarity.

Every KV site holds the same tokens, split in three regions by token index:

    [0, sink)                 sink tokens, pre-RoPE keys and values in the model dtype
    [sink, sink + encoded)    whole pages of ``page_size`` tokens stored as codes of their block
    [sink + encoded, length)  the window of newest tokens, in the model dtype

``sink`` is ``sink_tokens`` plus the left padding of the batch's most padded row (read from the prefill's
positions, where padding sits at position 0): every row keeps its first ``sink_tokens`` real tokens in
full precision and padding is never encoded; rows with less padding keep a few more tokens in full
precision. The most padded row (and every row of an unpadded batch) matches its own single run exactly.

When a forward has written its last site (the highest site id of the quantizer's layout), every complete
page older than the newest ``recent_window`` tokens is encoded, for every block at once (all T_c steps of
a block exist by then). The window therefore holds between ``recent_window`` and
``recent_window + page_size - 1`` tokens once the sequence is long enough: in prefill, the whole prompt
is attended in full precision and encoded afterwards; in decoding, every ``page_size`` generated tokens
the oldest window page of every layer and step is encoded. Keys are stored before RoPE and rotated with
their stored positions when read, decoded keys after decoding.

Decode steps (one new token) can attend straight from the codes: :meth:`QuantizedLoopKVCache.attend`, which
the models' attention calls when a cache offers it, runs :func:`~loopvq_calib.serving.decode_attention.decode_attention`
through the kernels' dispatch (``backend="auto"``: on CUDA, the shared-memory CUDA kernel where the site fits
it, else the Triton kernel; ``"cuda"`` / ``"triton"``: that kernel, Triton also on CPU under
``TRITON_INTERPRET=1``; ``"torch"``: never) and returns None otherwise, so that ``update`` (this reference
path) serves the call.

``quantizer`` is a calibrated :class:`~loopvq_calib.codes.quantizer.KVQuantizer` or a
:class:`~loopvq_calib.codes.baselines.BaselineQuantizer` (last-step KV, KIVI, fp8): any set of codecs with
``layout.kind``, ``layout.sites``, ``encode`` and ``decode`` covering every site. ``store="indices"`` keeps
the codes (uint8 indices + fp16 sigma for TaSQ keys; a baseline's packed integers, scales or float8 bytes);
``store="fake"`` keeps
full-precision tensors and overwrites the encoded tokens in place by decode(encode(.)) at the same
moments (the "quantize in place" comparison: identical outputs, no memory saving).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..codes.codec import BlockCodec, Codes
from ..codes.quantizer import KVQuantizer
from ..kernels import backends
from ..kernels.backends import CACHE_CHOICES, DISPATCH, Backend, BackendUnavailable, available
from .decode_state import KernelState

STORES = ("indices", "fake")


class QuantizedLoopKVCache:
    """KV cache with the same protocol as :class:`~loopvq_calib.models.cache.LoopKVCache`, codes in the middle."""

    is_compileable = False  # generate() asks (transformers 5.17 and 5.24)
    is_linear = (False,)  # generate() asks (5.24): attention layers, not a recurrent state

    def __init__(
        self,
        quantizer: KVQuantizer,
        sink_tokens: int,
        recent_window: int,
        *,
        page_size: int = 8,
        store: str = "indices",
        backend: Backend | str = Backend.AUTO,
    ) -> None:
        if store not in STORES:
            raise ValueError(f"store {store!r}; expected one of {', '.join(STORES)}")
        self.backend = Backend.parse(backend, CACHE_CHOICES, what="QuantizedLoopKVCache backend")
        if sink_tokens < 0 or recent_window < 0 or page_size < 1:
            raise ValueError(
                f"need sink_tokens >= 0, recent_window >= 0, page_size >= 1; got "
                f"{sink_tokens}, {recent_window}, {page_size}"
            )
        required = getattr(quantizer, "page_size", None)  # a baseline whose token groups are pages (KIVI keys)
        if required is not None and page_size != required:
            raise ValueError(f"{quantizer.method} encodes pages of {required} tokens; got page_size {page_size}")
        self.quantizer = quantizer
        self.sink_tokens = sink_tokens
        self.recent_window = recent_window
        self.page_size = page_size
        self.store = store
        self._kernel_state: KernelState | None = None  # made at the first kernel call
        self.num_steps: int | None = None
        self.last_site = max(s.site for s in quantizer.kv.sites)
        self.codec_of: dict[int, dict[str, str]] = {}  # site -> {"key": codec name, "value": codec name}
        for name, codec in quantizer.codecs.items():
            for site in codec.layout.sites:
                self.codec_of.setdefault(site, {})[codec.layout.kind] = name
        uncovered = [s.site for s in quantizer.kv.sites if set(self.codec_of.get(s.site, ())) != {"key", "value"}]
        if uncovered:
            raise ValueError(f"the quantizer has no key or value codec for KV sites {uncovered}")
        # full-precision tokens per site (sinks + window with store="indices"; everything with "fake")
        self.keys: dict[int, torch.Tensor] = {}  # pre-RoPE [B, S_fp, H, D]
        self.values: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}  # [B, S_total] absolute positions of every token
        self._position_storage: dict[int, torch.Tensor] = {}  # [B, capacity] behind positions[site] (doubles when full)
        self.encoded = 0  # tokens after the sinks held as codes (a multiple of page_size)
        self.sink_columns: int | None = None  # sink_tokens + the prefill's largest left padding (set on first update)
        self.codes: dict[str, list[Codes]] = {name: [] for name in quantizer.codecs}  # one entry per page
        self._is_user_defined = False

    # -- the cache protocol ------------------------------------------------------------------------
    def update(
        self,
        site: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        positions: torch.Tensor,
        rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's pre-RoPE ``key`` and ``value``; return the site's post-RoPE keys and values."""
        self._append(site, key, value, positions=positions)
        out_k, out_v = self.site_kv(site)
        out = rope(out_k, self.positions[site]), out_v  # at prefill the forward's own positions object (RoPE once)
        if site == self.last_site:
            self._encode_ready_pages()
        return out

    def attend(
        self, site: int, q: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor, ctx: Any
    ) -> torch.Tensor | None:
        """A decode step's attention from the codes (the CUDA or Triton kernel), or None when no kernel serves
        this call (more than one query token, ``store="fake"``, ``backend="torch"``, a baseline quantizer, no
        CUDA under ``auto``): the reference path does.

        q [B, 1, Hq, D] post-RoPE; key/value [B, 1, H, D] pre-RoPE; ``ctx`` the forward's context (RoPE
        convention, attention mask). Returns [B, 1, Hq * D]. The mask is applied to the full-precision tokens;
        coded tokens are never padding (left padding stays in the sink columns).
        """
        kernel = self.decode_backend(q)
        if kernel is None:
            return None
        self._append(site, key, value, positions=ctx.positions)
        if self._kernel_state is None:
            self._kernel_state = KernelState(self.quantizer.kv.head_dim, ctx.rope_theta)
        out = self._kernel_state.attend(self, site, q[:, 0], ctx=ctx, backend=kernel)
        if site == self.last_site:
            self._encode_ready_pages()
        return out.reshape(q.shape[0], 1, -1)

    def decode_backend(self, q: torch.Tensor) -> Backend | None:
        """The decode kernel's backend for this call, or None for the reference path. ``auto`` hands the call
        to decode attention's own dispatch (the CUDA kernel where the site fits it, else Triton) on a CUDA device
        where the Triton kernel, the fallback, runs; elsewhere the reference path serves. An explicit backend
        that cannot run here is refused before the cache changes."""
        if self.backend is Backend.TORCH or self.store != "indices" or q.shape[1] != 1:
            return None
        if not self.quantizer.fused_decode:  # a baseline's codes (or a method's that declares so): the reference path
            if self.backend is not Backend.AUTO:
                raise BackendUnavailable(
                    f"backend={self.backend.value!r} reads LoopVQ codes; {type(self.quantizer).__name__} has none"
                )
            return None
        kernels = list(backends.DECODE_CANDIDATES)
        if self.backend is Backend.AUTO:  # the last kernel is the one that takes every call
            return Backend.AUTO if q.device.type == "cuda" and available(kernels[-1].backend, q.device) else None
        DISPATCH.choose(
            self.backend, kernels, what="QuantizedLoopKVCache backend", choices=CACHE_CHOICES, device=q.device
        )
        return self.backend

    def _append(self, site: int, key: torch.Tensor, value: torch.Tensor, *, positions: torch.Tensor) -> None:
        if self.sink_columns is None:
            self.sink_columns = self.sink_tokens + int(left_padding(positions).max())
        if site in self.keys:
            key = torch.cat([self.keys[site], key], dim=1)  # sinks + window only: a few pages
            value = torch.cat([self.values[site], value], dim=1)
        self.keys[site], self.values[site] = key, value
        self.positions[site] = self._appended_positions(site, positions)

    def _appended_positions(self, site: int, new: torch.Tensor) -> torch.Tensor:
        """The site's positions with ``new`` appended, as a view of storage that doubles when full: amortised O(1)
        per token instead of a copy of every position at every decode step. The first call keeps ``new`` itself
        (the forward's positions object, whose RoPE factors the forward computes once)."""
        old = self.positions.get(site)
        if old is None:
            return new
        n, k = old.shape[1], new.shape[1]
        store = self._position_storage.get(site)
        if store is None or n + k > store.shape[1]:  # second call, or outgrown
            store = new.new_empty(new.shape[0], max(2 * (n + k), 64))
            store[:, :n] = old
            self._position_storage[site] = store
        store[:, n : n + k] = new
        return store[:, : n + k]

    def site_kv(self, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The site's pre-RoPE keys and values over all its tokens (decoded where stored as codes)."""
        k, v = self.keys[site], self.values[site]
        if self.store == "fake" or not self.encoded:
            return k, v
        s = self._sinks
        dk, dv = (self._decode(self.codec_of[site][kind], site, k.dtype) for kind in ("key", "value"))
        return torch.cat([k[:, :s], dk, k[:, s:]], 1), torch.cat([v[:, :s], dv, v[:, s:]], 1)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.positions:
            return 0
        return self.positions[min(self.positions)].shape[1]

    def check_steps(self, num_steps: int) -> None:
        """The loop count must be the quantizer's (site ids and blocks depend on it), and fixed per cache."""
        if num_steps != self.quantizer.kv.loop_steps:
            raise ValueError(
                f"the quantizer was calibrated for {self.quantizer.kv.loop_steps} loop steps; "
                f"this forward runs {num_steps}"
            )
        if self.num_steps is None:
            self.num_steps = num_steps
        elif self.num_steps != num_steps:
            raise ValueError(f"this cache was filled with {self.num_steps} loop steps, not {num_steps}")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch (beam search): full-precision tensors, positions and codes."""
        for store in (self.keys, self.values, self.positions):
            for site, t in store.items():
                store[site] = t.index_select(0, beam_idx.to(t.device))
        self._position_storage.clear()  # the reordered positions are copied into fresh storage at the next append
        for name, pages in self.codes.items():
            self.codes[name] = [_select_codes(c, beam_idx, self.page_size) for c in pages]
        if self._kernel_state is not None:
            self._kernel_state.buffers.clear()  # packed copies of the codes, rebuilt from the reordered pages

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def served_by_kernel(self) -> bool:
        """Whether this cache's decode steps went through the fused decode-attention kernel (its state is made
        at the first kernel call; the reference path leaves it unmade)."""
        return self._kernel_state is not None

    # -- regions -----------------------------------------------------------------------------------
    @property
    def _sinks(self) -> int:
        return self.sink_tokens if self.sink_columns is None else self.sink_columns

    @property
    def window(self) -> int:
        """Newest tokens in full precision (after the sinks and the encoded pages)."""
        return max(self.get_seq_length() - self._sinks - self.encoded, 0)

    def regions(self) -> dict[str, int]:
        """Token counts (columns) per region: sinks (with left padding), encoded, window; the same at every site."""
        n = self.get_seq_length()
        return {"sink": min(n, self._sinks), "encoded": self.encoded, "window": self.window}

    def _encode_ready_pages(self) -> None:
        while self.window >= self.recent_window + self.page_size:
            self._encode_page()

    def _encode_page(self) -> None:
        """Encode the oldest window page of every block (all its steps at once), keys and values."""
        start = self._sinks + (self.encoded if self.store == "fake" else 0)  # in the stored tensors
        page = slice(start, start + self.page_size)
        for name, codec in self.quantizer.codecs.items():
            store = self.keys if codec.layout.kind == "key" else self.values
            x = torch.stack([store[site][:, page] for site in codec.layout.sites], dim=2)  # [B, P, T, H, D]
            codes = codec.encode(x.flatten(0, 1).to(_codec_device(codec, x.device)))
            if self.store == "fake":
                y = codec.decode(codes).to(device=x.device, dtype=x.dtype).reshape(x.shape)
                for m, site in enumerate(codec.layout.sites):
                    store[site] = torch.cat([store[site][:, : page.start], y[:, :, m], store[site][:, page.stop :]], 1)
            else:
                self.codes[name].append(codes)
        if self.store == "indices":
            for store in (self.keys, self.values):
                for site, t in store.items():
                    store[site] = torch.cat([t[:, : page.start], t[:, page.stop :]], 1)
        self.encoded += self.page_size

    def _decode(self, name: str, site: int, dtype: torch.dtype) -> torch.Tensor:
        """Decoded tokens of the encoded region at ``site`` -> [B, encoded, H, D] in ``dtype``."""
        codec: BlockCodec = self.quantizer.codecs[name]
        m = codec.layout.sites.index(site)
        ref = self.keys[site]
        pages = [codec.decode(c)[:, m].reshape(ref.shape[0], self.page_size, *ref.shape[2:]) for c in self.codes[name]]
        return torch.cat(pages, dim=1).to(device=ref.device, dtype=dtype)

    # -- memory ------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the stored K/V payload: full-precision tokens, indices and sigma (positions excluded)."""
        fp = sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in s.values())
        return fp + self.code_bytes()

    def code_bytes(self) -> int:
        """Bytes of the stored codes (indices and TaSQ sigma)."""
        return sum(_codes_nbytes(c) for pages in self.codes.values() for c in pages)

    def bytes_per_token(self) -> dict[str, Any]:
        """Measured bytes per token of this cache against a bf16 cache of the same sites.

        ``bytes_per_token``: everything held / (batch * tokens); ``encoded_bytes_per_token``: codes per
        encoded token; ``full_precision_bytes_per_token``: a sink/window token at the stored dtype;
        ``bf16_bytes_per_token`` = sites * 2 (K and V) * H * D * 2 bytes.
        """
        kv = self.quantizer.kv
        first = self.keys[min(self.keys)] if self.keys else None
        batch = first.shape[0] if first is not None else 0
        tokens = self.get_seq_length()
        fp_elem = first.element_size() if first is not None else 2
        bf16 = kv.num_sites * 2 * kv.kv_heads * kv.head_dim * 2
        total = self.nbytes()
        per_token = total / (batch * tokens) if tokens and batch else 0.0
        encoded = self.code_bytes() / (batch * self.encoded) if self.encoded and self.store == "indices" else None
        return {
            "tokens": tokens,
            "batch": batch,
            **self.regions(),
            "store": self.store,
            "cache_bytes": total,
            "bytes_per_token": per_token,
            "encoded_bytes_per_token": encoded,
            "full_precision_bytes_per_token": kv.num_sites * 2 * kv.kv_heads * kv.head_dim * fp_elem,
            "bf16_bytes_per_token": bf16,
            "ratio_to_bf16": per_token / bf16,
        }


def _codec_device(codec: Any, default: torch.device) -> torch.device:
    """Where a codec encodes: its codebook's device (LoopVQ), else the tokens' own (baselines)."""
    codebook = getattr(codec, "codebook", None)
    return codebook.device if codebook is not None else default


def left_padding(positions: torch.Tensor) -> torch.Tensor:
    """Left-padding tokens of each row of ``positions`` [B, N]: padding takes position 0, as the real first token
    does (the models' build_context), so a row's padding is its count of zeros less one."""
    return ((positions == 0).sum(-1) - 1).clamp_min(0)


def _codes_nbytes(c: Any) -> int:
    """Stored bytes of one page's codes: indices and sigma (LoopVQ), or a baseline's own tensors."""
    if hasattr(c, "nbytes"):
        return c.nbytes()
    return c.indices.numel() * c.indices.element_size() + (
        c.sigma.numel() * c.sigma.element_size() if c.sigma is not None else 0
    )


def _select_codes(c: Any, beam_idx: torch.Tensor, page: int) -> Any:
    """Reorder the batch of one page's codes (rows are batch-major: b * page + token)."""
    if hasattr(c, "select"):
        return c.select(beam_idx)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, page, *t.shape[1:]).index_select(0, beam_idx.to(t.device)).flatten(0, 1)

    return Codes(pick(c.indices), pick(c.sigma) if c.sigma is not None else None)
