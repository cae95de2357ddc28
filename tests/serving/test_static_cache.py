"""The static quantized cache (serving/static_cache.py) stepped without graphs (serving/graph_decode.py off CUDA):
the eager QuantizedLoopKVCache's logits and regions at every decode step across page boundaries, its layout after
from_cache, and what it refuses. The same through the Triton kernel in its interpreter (slow)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_huginn, make_tiny_ouro, needs_triton_kernels
from support.decode import gen, lockstep, prefill
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.baselines import make_baseline
from loopvq_calib.serving.cache import QuantizedLoopKVCache
from loopvq_calib.serving.graph_decode import GraphDecoder
from loopvq_calib.serving.static_cache import StaticQuantizedLoopKVCache

SERVING = dict(sink_tokens=4, recent_window=8, page_size=4)


def ouro_case(length: int = 21, padded: bool = True):
    """Tiny Ouro (half RoPE), TaSQ+LoopVQ (4 steps per block), a batch of 2 with row 1 left-padded by 3."""
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, length), generator=gen(0))
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :3] = 0
    q = sampled_quantizer(model, prompt, "tasq+loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    return model, prompt, (mask if padded else None), q


def huginn_case():
    """Tiny Huginn (interleaved RoPE, single-site prelude/coda blocks, core blocks of 2 steps), LoopVQ."""
    model = make_tiny_huginn()
    prompt = torch.randint(0, 4096, (2, 14), generator=gen(1))
    q = sampled_quantizer(model, prompt, "loopvq", codebook_size=16, group_size=8, steps_per_block=2)
    return model, prompt, None, q


def run_both(case, steps: int, *, backend: str = "torch", **serving):
    """The eager cache (reference path) and a static cache made from an identical prefill, stepped in lockstep."""
    model, prompt, mask, q = case
    serving = serving or SERVING
    eager, ids = prefill(model, prompt, q, mask=mask, **serving)
    start, _ = prefill(model, prompt, q, mask=mask, backend=backend, **serving)
    static = StaticQuantizedLoopKVCache.from_cache(start, max_length=prompt.shape[1] + steps)
    decoder = GraphDecoder(model, static)
    return list(lockstep(model, eager, decoder, ids=ids, steps=steps, mask=mask)), static


@pytest.mark.parametrize("case", [ouro_case, huginn_case], ids=["ouro-padded-tasq", "huginn-loopvq"])
def test_static_steps_give_the_eager_logits_across_pages(case):
    """Every decode step's logits equal the eager cache's (float32, up to the order of SDPA's sums: the static
    cache attends over its ring and masked columns), with the same regions; pages are encoded on the way and the
    ring wraps around."""
    steps, static = run_both(case(), 14)
    for want, got, eager_regions, static_regions in steps:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert static_regions == eager_regions
    assert steps[-1][3]["encoded"] - steps[0][3]["encoded"] >= 12  # three pages or more during the steps
    assert static.length == static.max_length and static.served_by_kernel is False


def test_a_prompt_shorter_than_the_sinks_fills_them_first():
    """Three prompt tokens and 4 sinks: the first decode steps go to sink columns, then the window; equal
    logits at every step; the last is refused once max_length tokens are held."""
    steps, static = run_both(ouro_case(length=3, padded=False), 20)
    for want, got, eager_regions, static_regions in steps:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert static_regions == eager_regions
    assert static.regions() == {"sink": 4, "encoded": 8, "window": 11}
    with pytest.raises(ValueError, match="the static cache is full: it was made for max_length 23"):
        static.page_due()


def test_from_cache_lays_the_prefill_out_in_columns_and_slots():
    """After a left-padded prefill of 21 tokens (7 sink columns, 4 encoded, a window of 10): sinks in columns 0-6,
    window token t in column 7 + (t - 7) % 12, positions and mask (row 1's padding masked) with them, the eager
    pages in the first coded slots (head-major), counters and capacity for max_length."""
    model, prompt, mask, q = ouro_case()
    eager, _ = prefill(model, prompt, q, mask=mask, **SERVING)
    static = StaticQuantizedLoopKVCache.from_cache(eager, max_length=40)
    assert static.sinks == 7 and static.ring == 12 and static.capacity == 28  # 7 pages: ceil((40 - 7 - 8) / 4)
    assert static.regions() == eager.regions() == {"sink": 7, "encoded": 4, "window": 10}
    columns = [*range(7), *(7 + (t - 7) % 12 for t in range(11, 21))]
    for site in (0, 5):
        assert torch.equal(static.keys[site][:, columns], eager.keys[site])
        assert torch.equal(static.values[site][:, columns], eager.values[site])
        assert not static.keys[site][:, [9, 10]].any()  # the ring's free columns
    pos = eager.positions[0]
    assert torch.equal(static.fp_positions[:, columns], pos[:, [*range(7), *range(11, 21)]].int())
    want_mask = torch.ones(2, 17, dtype=torch.int8)
    want_mask[1, :3] = 0
    assert torch.equal(static.fp_mask[:, columns], want_mask) and not static.fp_mask[:, [9, 10]].any()
    assert static.first_position.tolist() == [7, 4] and static.next_positions().tolist() == [[21], [18]]
    for name, pages in eager.codes.items():
        assert torch.equal(static.codes[name].indices[:, :4], pages[0].indices.view(2, 4, *pages[0].indices.shape[1:]))
        assert static.codes[name].indices.stride(1) == static.codes[name].indices.shape[3]  # head-major
    assert (static.coded.item(), static.tokens.item(), static.length, static.encoded) == (4, 21, 21, 4)


def test_capture_leaves_the_host_mirrors_and_replays_advance_them():
    """While a step is captured its page decision is the one asked and the host's counters come back unchanged;
    a replayed step advances them (by a page when it encoded one)."""
    model, prompt, mask, q = ouro_case()
    eager, _ = prefill(model, prompt, q, mask=mask, **SERVING)
    static = StaticQuantizedLoopKVCache.from_cache(eager, max_length=40)
    assert static.page_due() is False  # window 10 + 1 < 8 + 4
    with static.capturing(encode=True):
        assert static.page_due() is True
        static.length, static.encoded = 99, 99
    assert (static.length, static.encoded, static.page_due()) == (21, 4, False)
    static.replayed(encode=False)
    assert static.page_due() is True  # window 12 after the next token
    static.replayed(encode=True)
    assert (static.length, static.encoded) == (23, 8)


def test_what_a_static_cache_refuses():
    """A prefill through it, an unfilled or fake-store source, a baseline quantizer, a max_length below the tokens
    held, a quantizer on another device, and more than one token per step."""
    model, prompt, mask, q = ouro_case()
    eager, ids = prefill(model, prompt, q, mask=mask, **SERVING)
    static = StaticQuantizedLoopKVCache.from_cache(eager, max_length=30)
    with pytest.raises(ValueError, match="prefill a QuantizedLoopKVCache, then"), torch.inference_mode():
        model(prompt, cache=static, use_cache=True)
    with pytest.raises(ValueError, match="one new token per sequence"):
        static.attend(0, torch.zeros(2, 2, 4, 16), key=None, value=None, ctx=None)
    with pytest.raises(ValueError, match="prefilled QuantizedLoopKVCache with store='indices'"):
        StaticQuantizedLoopKVCache.from_cache(QuantizedLoopKVCache(q, **SERVING), max_length=30)
    fake, _ = prefill(model, prompt, q, mask=mask, store="fake", **SERVING)
    with pytest.raises(ValueError, match="store='indices'"):
        StaticQuantizedLoopKVCache.from_cache(fake, max_length=30)
    with pytest.raises(ValueError, match="holds 21 tokens, more than max_length 20"):
        StaticQuantizedLoopKVCache.from_cache(eager, max_length=20)
    with pytest.raises(ValueError, match="LoopVQ codes; BaselineQuantizer has none"):
        StaticQuantizedLoopKVCache(
            make_baseline("fp8", model.kv_layout()),
            4,
            8,
            page_size=8,
            batch=1,
            max_length=64,
            dtype=torch.float32,
            device="cpu",
        )
    with pytest.raises(ValueError, match="codec .* is on cpu, the cache on meta"):
        StaticQuantizedLoopKVCache(q, 4, 8, page_size=4, batch=1, max_length=64, dtype=torch.float32, device="meta")


@needs_triton_kernels
@pytest.mark.slow  # about a minute in the interpreter
def test_static_steps_through_the_triton_kernel():
    """backend="triton" (the interpreter on CPU): the kernel reads the coded count from the device and attends
    over every column under the mask; logits as the eager reference path's, across pages."""
    steps, static = run_both(ouro_case(), 10, backend="triton")
    for want, got, eager_regions, static_regions in steps:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert static_regions == eager_regions
    assert static.served_by_kernel and static.encoded - 4 >= 8
