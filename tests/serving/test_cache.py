"""The reference quantized KV cache: page rules, equality with quantize-in-place, generate(), byte accounting."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA, REFERENCE_MODEL, make_tiny_huginn, make_tiny_ouro
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.objective import teacher
from loopvq_calib.models import LoopKVCache
from loopvq_calib.models.base import CACHE_FIELD
from loopvq_calib.models.loading import load_model
from loopvq_calib.serving.cache import QuantizedLoopKVCache


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model(REFERENCE_MODEL, "float32", torch.device("cpu"))
    text = json.loads((DATA / "shakespeare-heldout.jsonl").read_text().splitlines()[0])["text"][:4000]
    ids = torch.tensor([tok(text)["input_ids"][:160]])
    quantizer = sampled_quantizer(model, ids[:, :128], "loopvq", codebook_size=16, group_size=16, steps_per_block=4)
    return model, ids, quantizer


def generate(model, ids, cache, new_tokens):
    """Greedy generate() with a user cache under the installed transformers' argument name (None: the
    model's own LoopKVCache)."""
    user = {CACHE_FIELD: cache} if cache is not None else {}
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **user,
    )
    return out.sequences, torch.stack(out.logits, 1)


def greedy(model, prompt, cache, new_tokens, **kw):
    """Explicit forward calls: prefill, then one token at a time; yields (logits of the step, cache)."""
    out = model(prompt, cache=cache, use_cache=True, **kw)
    yield out.logits[:, -1]
    for _ in range(new_tokens):
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True, **kw)
        yield out.logits[:, -1]


def expected_regions(total: int, sink: int, window: int, page: int) -> dict[str, int]:
    encoded = max(total - sink - window, 0) // page * page
    return {"sink": min(total, sink), "encoded": encoded, "window": max(total - sink - encoded, 0)}


def test_generate_matches_fake_store_and_differs_from_full_precision(reference):
    model, ids, q = reference
    prompt = ids[:, :37]  # prefill encodes one page, decoding two more
    runs = {}
    for store in ("indices", "fake"):
        cache = QuantizedLoopKVCache(q, sink_tokens=8, recent_window=16, page_size=8, store=store)
        runs[store] = generate(model, prompt, cache, 12)
        assert cache.regions() == expected_regions(48, 8, 16, 8)  # the last generated token is never fed
    plain = generate(model, prompt, None, 12)
    assert torch.equal(runs["indices"][0], runs["fake"][0])
    assert (runs["indices"][1] - runs["fake"][1]).abs().max() <= 1e-5
    assert torch.equal(runs["indices"][1][:, 0], plain[1][:, 0])  # prefill attends full precision
    assert (runs["indices"][1] - plain[1]).abs().max() > 1e-2  # the encoded pages do change the outputs


def test_huge_window_equals_plain_cache(reference):
    model, ids, q = reference
    prompt = ids[:, :32]
    cache = QuantizedLoopKVCache(q, sink_tokens=8, recent_window=10_000)
    seq, logits = generate(model, prompt, cache, 10)
    seq0, logits0 = generate(model, prompt, None, 10)
    assert cache.encoded == 0 and not any(cache.codes.values())
    assert torch.equal(seq, seq0)
    assert (logits - logits0).abs().max() <= 1e-5


@pytest.mark.parametrize("store", ["indices", "fake"])
def test_regions_follow_page_rules_at_every_step(store):
    model = make_tiny_ouro()
    q = sampled_quantizer(
        model,
        torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1)),
        "loopvq",
        codebook_size=16,
        group_size=8,
        steps_per_block=4,
    )
    prompt = torch.randint(0, 4096, (2, 21), generator=torch.Generator().manual_seed(2))
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8, page_size=8, store=store)
    plain = LoopKVCache()
    first = model(prompt, cache=plain, use_cache=True).logits[:, -1]
    for i, logits in enumerate(greedy(model, prompt, cache, 20)):
        total = 21 + i
        want = expected_regions(total, 4, 8, 8)
        assert cache.get_seq_length() == total
        assert cache.regions() == want
        assert 8 <= want["window"] <= 15
        stored = total if store == "fake" else want["sink"] + want["window"]
        assert all(k.shape[1] == stored for k in cache.keys.values())
        assert all(len(pages) == (want["encoded"] // 8 if store == "indices" else 0) for pages in cache.codes.values())
        if i == 0:
            assert torch.equal(logits, first)  # the prompt is attended in full precision, encoded after


def test_prefill_pages_hold_decode_encode_of_full_precision_keys():
    """After prefill the encoded region of every site equals decode(encode(.)) of the teacher's keys and
    values (joint over the block's loop steps); sinks and window are the teacher's exactly."""
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, 30), generator=torch.Generator().manual_seed(3))
    q = sampled_quantizer(model, prompt, "tasq+loopvq", codebook_size=16, group_size=8, steps_per_block=2)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8, page_size=8)
    model(prompt, cache=cache, use_cache=True)
    fp = teacher(model, prompt)
    qk, qv = q.quantize_sites(fp.keys, fp.values)
    assert cache.regions() == {"sink": 4, "encoded": 16, "window": 10}
    for site in fp.keys:
        k, v = cache.site_kv(site)
        for got, ref, rec in ((k, fp.keys[site], qk[site]), (v, fp.values[site], qv[site])):
            assert torch.equal(got[:, :4], ref[:, :4]) and torch.equal(got[:, 20:], ref[:, 20:])
            torch.testing.assert_close(got[:, 4:20], rec[:, 4:20], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make, method, steps",
    [
        (make_tiny_ouro, "loopvq", 4),
        (make_tiny_ouro, "tasq+loopvq", 4),
        (make_tiny_huginn, "tasq+loopvq", 2),
        (make_tiny_huginn, "cq", 1),
    ],
)
def test_bytes_per_token_match_hand_computation(make, method, steps):
    model = make()
    kv = model.kv_layout()
    g = 8
    q = sampled_quantizer(
        model, torch.randint(0, 4096, (1, 24)), method, codebook_size=16, group_size=g, steps_per_block=steps
    )
    cache = QuantizedLoopKVCache(q, sink_tokens=8, recent_window=16, page_size=8)
    prompt = torch.randint(0, 4096, (2, 50))
    for _ in greedy(model, prompt, cache, 5):
        pass
    b, total = 2, 55
    enc, fp_tokens = 24, 8 + 23
    assert cache.regions() == {"sink": 8, "encoded": enc, "window": 23}
    h, d, sites = kv.kv_heads, kv.head_dim, kv.num_sites
    # one uint8 index per (head, group) and block; TaSQ keys add one fp16 sigma per (token, step)
    index_bytes = sum(h * len(blk.sites) * d // g for blk in kv.blocks(steps if method != "cq" else 1)) * 2
    sigma_bytes = 2 * sites if method.startswith("tasq") else 0  # every site is in one key block
    fp_bytes = fp_tokens * sites * 2 * h * d * 4  # fp32 model
    want = b * (fp_bytes + enc * (index_bytes + sigma_bytes))
    report = cache.bytes_per_token()
    assert cache.nbytes() == report["cache_bytes"] == want
    assert report["bytes_per_token"] == want / (b * total)
    assert report["encoded_bytes_per_token"] == index_bytes + sigma_bytes
    assert report["bf16_bytes_per_token"] == sites * 2 * h * d * 2
    assert report["ratio_to_bf16"] == pytest.approx(want / (b * total) / (sites * 2 * h * d * 2))


def test_huginn_generation_matches_fake_store():
    model = make_tiny_huginn()
    kv = model.kv_layout()
    q = sampled_quantizer(
        model, torch.randint(0, 4096, (1, 48)), "loopvq", codebook_size=16, group_size=8, steps_per_block=2
    )
    assert {len(c.layout.sites) for c in q.codecs.values()} == {1, 2}  # prelude/coda alone, core in pairs
    assert len(q.codecs) == 2 * (2 + kv.loop_steps // 2 * 2)
    prompt = torch.randint(0, 4096, (1, 19))
    runs = {}
    for store in ("indices", "fake"):
        cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8, page_size=8, store=store)
        runs[store] = generate(model, prompt, cache, 14)
        assert cache.regions() == expected_regions(32, 4, 8, 8)
    assert torch.equal(runs["indices"][0], runs["fake"][0])
    assert (runs["indices"][1] - runs["fake"][1]).abs().max() <= 1e-5


def test_loop_count_must_match_the_quantizer():
    model = make_tiny_huginn()
    q = sampled_quantizer(model, torch.randint(0, 4096, (1, 16)), "cq", codebook_size=16, group_size=8)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8)
    with pytest.raises(ValueError, match="calibrated for 4 loop steps"):
        model(torch.randint(0, 4096, (1, 8)), cache=cache, use_cache=True, num_steps=2)


def test_reorder_cache_permutes_every_region():
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, 30))
    q = sampled_quantizer(model, prompt, "tasq+loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8)
    model(prompt, cache=cache, use_cache=True)
    assert cache.encoded == 16
    before = {s: cache.site_kv(s) for s in cache.keys}
    cache.reorder_cache(torch.tensor([1, 0]))
    for s, (k, v) in before.items():
        k2, v2 = cache.site_kv(s)
        assert torch.equal(k2, k.flip(0)) and torch.equal(v2, v.flip(0))


def test_positions_grow_in_place_and_survive_a_reorder():
    """Appending a decode step's positions writes into storage that doubles when full (amortised: no copy of every
    position at every step); the positions equal the concatenation, also after reorder_cache."""
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, 10))
    q = sampled_quantizer(model, prompt, "loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8)
    k = torch.zeros(2, 1, q.kv.kv_heads, q.kv.head_dim)
    cache._append(0, k.expand(-1, 3, -1, -1), k.expand(-1, 3, -1, -1), positions=torch.arange(1, 4).repeat(2, 1))
    storages = set()
    for t in range(4, 300):
        cache._append(0, k, k, positions=torch.tensor([[t], [t + 1000]]))
        storages.add(cache.positions[0].data_ptr())
    expect = torch.stack([torch.arange(1, 300), torch.cat([torch.arange(1, 4), torch.arange(1004, 1300)])])
    assert torch.equal(cache.positions[0], expect)
    assert len(storages) <= 4  # 64 -> 128 -> 256 -> 512 columns
    cache.reorder_cache(torch.tensor([1, 0]))
    cache._append(0, k, k, positions=torch.tensor([[7], [8]]))
    assert torch.equal(cache.positions[0], torch.cat([expect.flip(0), torch.tensor([[7], [8]])], 1))


def test_prefill_rotates_by_the_forward_positions_object():
    """At prefill the cache rotates its keys by the forward's own positions tensor (the object whose RoPE
    factors ForwardContext.rope computes once for every site), not by its stored copy; later, by every
    position it holds."""
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, 10))
    q = sampled_quantizer(model, prompt, "loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8)
    k = torch.randn(2, 5, q.kv.kv_heads, q.kv.head_dim)
    seen = []

    def rope(x, positions):
        seen.append(positions)
        return x

    prefill = torch.arange(5).repeat(2, 1)
    cache.update(0, k, k, positions=prefill, rope=rope)
    cache.update(0, k[:, :1], k[:, :1], positions=torch.tensor([[5], [5]]), rope=rope)
    assert seen[0] is prefill
    assert torch.equal(seen[1], torch.arange(6).repeat(2, 1))


def test_bad_arguments():
    model = make_tiny_ouro()
    q = sampled_quantizer(model, torch.randint(0, 4096, (1, 16)), "cq", codebook_size=16, group_size=8)
    with pytest.raises(ValueError, match="store"):
        QuantizedLoopKVCache(q, 4, 8, store="packed")
    q.codecs.pop(next(iter(q.codecs)))
    with pytest.raises(ValueError, match="no key or value codec"):
        QuantizedLoopKVCache(q, 4, 8)


def test_left_padded_batch_keeps_every_rows_sinks_in_full_precision(reference):
    """A batch with a left-padded short prompt: the sink region covers the padding plus the short row's
    sinks (padding is never encoded), and the short row's logits equal its own single run; a longer
    row keeps a few extra tokens in full precision."""
    model, ids, q = reference
    long, short = ids[:, :45], ids[:, 60:85]  # 45 and 25 tokens
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=ids.dtype), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    cache = QuantizedLoopKVCache(q, sink_tokens=8, recent_window=8, page_size=8)
    out = model(batch, attention_mask=mask, cache=cache, use_cache=True)
    logits, m = [out.logits[:, -1]], mask
    for _ in range(10):
        m = torch.cat([m, torch.ones(2, 1, dtype=m.dtype)], 1)
        out = model(out.logits[:, -1:].argmax(-1), attention_mask=m, cache=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    assert cache.regions()["sink"] == 8 + pad and cache.regions()["encoded"] > 0
    alone = QuantizedLoopKVCache(q, sink_tokens=8, recent_window=8, page_size=8)
    single = list(greedy(model, short, alone, 10))
    assert alone.regions()["sink"] == 8 and alone.regions()["encoded"] > 0
    torch.testing.assert_close(torch.stack(logits)[:, 1], torch.stack(single)[:, 0], atol=1e-4, rtol=1e-4)
