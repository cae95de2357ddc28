"""The synthetic caches of benchmarks/decode/bench_decode_model.py: a bundle-shaped quantizer with random codebooks, the
contents a prefill leaves (random bf16 sinks/window, random codes of every page) put into an empty
:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` without a forward (:func:`fill_cache`), the model's own
cache holding those contents decoded (what the coded cache must serve), and a bf16 cache of random tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from loopvq_calib.calibration.tasq.grouping import channel_units
from loopvq_calib.codes.codec import BlockCodec, Codes, TasqTransform, index_dtype
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import QuantConfig
from loopvq_calib.models import LoopKVCache
from loopvq_calib.models.common import apply_rope, rope_angles
from loopvq_calib.serving.cache import QuantizedLoopKVCache


@dataclasses.dataclass
class Serving:
    """The served cache's regions (the bundle's serving defaults)."""

    sink_tokens: int = 8
    recent_window: int = 64
    page_size: int = 8


def channels_groups(kv: Any, steps: int, group_size: int, gen: torch.Generator) -> torch.Tensor:
    """A ``tasq.grouping: channels`` key layout [H, n, G]: the TaSQ stage's units (one RoPE pair at every step)
    merged at random, coordinates ascending, codes by their first coordinate, as the stage writes them."""
    units = channel_units(kv.head_dim, steps, kv.rope_style)
    heads = []
    for _ in range(kv.kv_heads):
        groups = units[torch.randperm(len(units), generator=gen)].reshape(-1, group_size).sort(-1).values
        heads.append(groups[groups[:, 0].argsort()])
    return torch.stack(heads)


def synthetic_quantizer(
    kv: Any,
    method: str,
    *,
    codebook_size: int,
    group_size: int,
    steps_per_block: int,
    device: torch.device,
    seed: int = 0,
) -> KVQuantizer:
    """A bundle-shaped quantizer: the method's layouts, random float32 codebooks; TaSQ keys grouped by a random
    per-head permutation (``free``; a ``-channels`` suffix: :func:`channels_groups`) with random channel
    weights."""
    method, channels = method.removesuffix("-channels"), method.endswith("-channels")
    quant = QuantConfig(
        method=method, bits=None, codebook_size=codebook_size, group_size=group_size, steps_per_block=steps_per_block
    )
    gen, on_device = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)
    codecs = {}
    for layout in plan_layouts(kv, quant):
        transform = None
        if quant.uses_tasq and layout.kind == "key":
            coords = layout.steps * kv.head_dim
            if channels:
                groups = channels_groups(kv, layout.steps, group_size, gen)
            else:
                groups = torch.stack([torch.randperm(coords, generator=gen) for _ in range(kv.kv_heads)])
            layout = dataclasses.replace(layout, groups=groups.view(kv.kv_heads, -1, group_size))
            weight = torch.rand(layout.steps, kv.kv_heads, kv.head_dim, generator=gen) + 0.5
            transform = TasqTransform(weight.to(device))
        book = torch.randn(
            kv.kv_heads, layout.num_groups, codebook_size, group_size, generator=on_device, device=device
        )
        codecs[layout.key] = BlockCodec(layout, book, transform)
    return KVQuantizer(codecs, method, codebook_size, group_size, quant.block_steps, "none", kv)


def coded_pages(context: int, serving: Serving) -> int:
    """Pages a cache of ``context`` tokens holds as codes after a prefill (window in [recent, recent + page))."""
    return max(context - serving.sink_tokens - serving.recent_window, 0) // serving.page_size


def fill_cache(
    cache: QuantizedLoopKVCache,
    keys: dict[int, torch.Tensor],
    values: dict[int, torch.Tensor],
    *,
    positions: torch.Tensor,
    codes: dict[str, list[Codes]],
) -> QuantizedLoopKVCache:
    """Give an empty ``store="indices"`` cache the contents a prefill leaves, without a forward: per KV site the
    pre-RoPE sink and window tokens ``keys`` / ``values`` [B, S_fp, H, D] (the first ``sink_tokens`` are the
    sinks); ``positions`` [B, S], every token's position (an unpadded batch, shared by the sites); per codec the
    codes of its encoded pages, oldest first, each page's rows batch-major (b * page_size + token). S = S_fp +
    page_size * pages. Returns the cache."""
    if cache.keys or cache.store != "indices":
        raise ValueError("fill_cache needs an empty cache with store='indices'")
    sites = {s.site for s in cache.quantizer.kv.sites}
    if set(keys) != sites or set(values) != sites or set(codes) != set(cache.quantizer.codecs):
        raise ValueError("fill_cache needs keys and values for every KV site and codes for every codec")
    pages = {len(p) for p in codes.values()}
    fp = {t.shape[1] for t in (*keys.values(), *values.values())}
    if len(pages) != 1 or len(fp) != 1:
        raise ValueError(
            f"every codec needs the same number of pages (got {sorted(pages)}) and every site the "
            f"same full-precision tokens (got {sorted(fp)})"
        )
    encoded, n_fp = pages.pop() * cache.page_size, fp.pop()
    if (encoded and n_fp < cache.sink_tokens) or n_fp + encoded != positions.shape[1]:
        raise ValueError(
            f"{n_fp} full-precision and {encoded} coded tokens with {cache.sink_tokens} sinks do not "
            f"make the {positions.shape[1]} positions given"
        )
    cache.keys, cache.values = dict(keys), dict(values)
    cache.positions = dict.fromkeys(sites, positions)
    cache.codes = {name: list(p) for name, p in codes.items()}
    cache.encoded, cache.sink_columns = encoded, cache.sink_tokens
    return cache


def random_contents(
    quantizer: KVQuantizer, serving: Serving, context: int, *, batch: int, device: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    """Arguments of :func:`fill_cache`: random bf16 sinks/window and random codes of every page (each
    codec's pages views of one tensor)."""
    kv, page = quantizer.kv, serving.page_size
    pages = coded_pages(context, serving)
    n_fp = context - pages * page
    shape = (batch, n_fp, kv.kv_heads, kv.head_dim)
    keys = {s.site: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) for s in kv.sites}
    values = {s.site: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) for s in kv.sites}
    codes = {}
    for name, codec in quantizer.codecs.items():
        rows = (pages, batch * page)
        idx = torch.randint(
            0,
            codec.codebook.shape[2],
            (*rows, kv.kv_heads, codec.layout.num_groups),
            device=device,
            generator=gen,
            dtype=index_dtype(codec.codebook.shape[2]),
        )
        sigma = None
        if codec.transform is not None:
            sigma = (torch.rand(*rows, codec.layout.steps, device=device, generator=gen) + 0.5).half()
        codes[name] = [Codes(idx[i], None if sigma is None else sigma[i]) for i in range(pages)]
    positions = torch.arange(context, device=device).repeat(batch, 1)
    return {"keys": keys, "values": values, "positions": positions, "codes": codes}


def decoded_cache(quantizer: KVQuantizer, contents: dict[str, Any], serving: Serving) -> LoopKVCache:
    """The model's own cache holding ``contents`` decoded (codes -> bf16, then RoPE at their positions): what the
    coded cache must serve."""
    kv, page, sinks = quantizer.kv, serving.page_size, serving.sink_tokens
    keys, values, positions = contents["keys"], contents["values"], contents["positions"]
    batch = positions.shape[0]
    cache = LoopKVCache()
    for name, codec in quantizer.codecs.items():
        pages = contents["codes"][name]
        full = keys if codec.layout.kind == "key" else values
        if pages:
            codes = Codes(
                torch.cat([c.indices for c in pages]),
                None if pages[0].sigma is None else torch.cat([c.sigma for c in pages]),
            )
            x = codec.decode(codes).view(len(pages), batch, page, codec.layout.steps, kv.kv_heads, kv.head_dim)
            x = x.transpose(0, 1).flatten(1, 2)  # [B, pages * page, T, H, D]
        for m, site in enumerate(codec.layout.sites):
            t = full[site]
            if pages:
                t = torch.cat([t[:, :sinks], x[:, :, m].to(t.dtype), t[:, sinks:]], 1)
            if codec.layout.kind == "key":
                angles = rope_angles(positions, kv.head_dim, kv.rope_theta)
                cache.keys[site] = apply_rope(t, *angles, style=kv.rope_style)
            else:
                cache.values[site] = t
    return cache


def bf16_cache(kv: Any, context: int, batch: int, *, device: torch.device, gen: torch.Generator) -> LoopKVCache:
    """The model's own cache holding random post-RoPE keys and values of ``context`` tokens at every site."""
    cache = LoopKVCache()
    shape = (batch, context, kv.kv_heads, kv.head_dim)
    for s in kv.sites:
        cache.keys[s.site] = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        cache.values[s.site] = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
    return cache
