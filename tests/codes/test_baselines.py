"""Baselines as cache codecs: values against independent computations, stored bytes, served through the cache."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_huginn, make_tiny_ouro

from loopvq_calib.codes.baselines import BASELINES, make_baseline, pack_bits, unpack_bits
from loopvq_calib.codes.objective import quantized_logits, teacher
from loopvq_calib.serving.cache import QuantizedLoopKVCache


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip_and_size(bits):
    q = torch.randint(0, 2**bits, (5, 3, 64))
    p = pack_bits(q, bits)
    assert p.dtype == torch.uint8 and p.shape == (5, 3, 64 * bits // 8)
    assert torch.equal(unpack_bits(p, bits).long(), q)


def _affine(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference asymmetric quantization of each row of z [..., g] (fp16 scale and minimum)."""
    lo, hi = z.min(-1, keepdim=True).values, z.max(-1, keepdim=True).values
    s = ((hi - lo) / (2**bits - 1)).half().float()
    lo = lo.half().float()
    return ((z - lo) / s).round().clamp(0, 2**bits - 1) * s + lo


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_per_channel_values_per_token(bits):
    kv = make_tiny_ouro(head_dim=32, hidden_size=128).kv_layout()
    q = make_baseline(f"kivi{bits}", kv, group=16)
    x = torch.randn(40, 1, 4, 32)  # 40 tokens: two whole token groups of 16 and a last one of 8
    keys = q.codecs["key.s0"].quantize(x)
    for start in (0, 16, 32):
        chunk = x[start : start + 16]  # per channel: quantization over the tokens of the group
        expected = _affine(chunk.movedim(0, -1), bits).movedim(-1, 0)
        torch.testing.assert_close(keys[start : start + 16], expected)
    values = q.codecs["value.s0"].quantize(x)
    expected = _affine(x.unflatten(-1, (2, 16)), bits).flatten(-2)  # per token: groups of 16 channels
    torch.testing.assert_close(values, expected)


def test_fp8_and_last_step_decode():
    kv = make_tiny_ouro().kv_layout()
    x = torch.randn(6, 1, 4, 16) * 100
    x[0, 0, 0, 0] = 1000.0  # saturates at the largest e4m3 value
    y = make_baseline("fp8", kv).codecs["key.s0"].quantize(x)
    assert y[0, 0, 0, 0] == 448.0
    torch.testing.assert_close(y[1:], x[1:].to(torch.float8_e4m3fn).float())
    last = make_baseline("last-step-kv", kv)
    codec = last.codecs["value.l1"]
    assert codec.layout.sites == (1, 3, 5, 7)  # layer 1 at loop steps 0..3
    block = torch.randn(5, 4, 4, 16)
    assert torch.equal(codec.quantize(block), block[:, 3:4].expand(-1, 4, -1, -1))


def test_every_site_is_covered_on_huginn_and_names_are_checked():
    kv = make_tiny_huginn().kv_layout()
    for name in BASELINES:
        q = make_baseline(name, kv, group=16)
        covered = {(c.layout.kind, s) for c in q.codecs.values() for s in c.layout.sites}
        assert covered == {(k, s.site) for k in ("key", "value") for s in kv.sites}
    with pytest.raises(ValueError, match="unknown baseline 'kivi3'"):
        make_baseline("kivi3", kv)
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of the group size 32"):
        make_baseline("kivi2", kv)


@pytest.mark.parametrize("name", BASELINES)
def test_served_bytes_per_token_equal_the_stored_tensors(name):
    """Encoded bytes per token from the cache's own tensors against a hand count per baseline."""
    model = make_tiny_ouro()  # 2 layers x 4 steps = 8 sites, 4 KV heads of 16 channels, fp32
    kv = model.kv_layout()
    q = make_baseline(name, kv, group=16)
    cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=8, page_size=q.page_size)
    ids = torch.randint(0, 4096, (2, 4 + 2 * q.page_size + 8))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    m = cache.bytes_per_token()
    h, d, sites = 4, 16, 8
    per_site_kind = {
        "fp8": h * d,
        "last-step-kv": None,
        "kivi2": h * d * 2 // 8 + h * d * 2 * 2 // 16,  # packed codes + fp16 scale/min per group
        "kivi4": h * d * 4 // 8 + h * d * 2 * 2 // 16,
    }[name]
    expected = 2 * 2 * h * d * 4 if name == "last-step-kv" else sites * 2 * per_site_kind  # 2 layers, fp32
    assert m["encoded"] == 2 * q.page_size and m["encoded_bytes_per_token"] == expected
    fp_tokens = m["sink"] + m["window"]
    assert m["cache_bytes"] == 2 * (fp_tokens * sites * 2 * h * d * 4 + m["encoded"] * expected)


def test_kivi_cache_decodes_what_it_encoded_and_reorders():
    model = make_tiny_ouro(head_dim=32, hidden_size=128)
    q = make_baseline("kivi4", model.kv_layout(), group=8)
    with pytest.raises(ValueError, match="kivi4 encodes pages of 8 tokens; got page_size 16"):
        QuantizedLoopKVCache(q, 2, 4, page_size=16)
    cache = QuantizedLoopKVCache(q, 2, 4, page_size=8)
    fake = QuantizedLoopKVCache(q, 2, 4, page_size=8, store="fake")
    ids = torch.randint(0, 4096, (2, 30))
    with torch.no_grad():
        a = model(ids, cache=cache, use_cache=True).logits
        b = model(ids, cache=fake, use_cache=True).logits
        a2 = model(ids[:, :1], cache=cache, use_cache=True).logits
        b2 = model(ids[:, :1], cache=fake, use_cache=True).logits
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a2, b2, atol=1e-5, rtol=1e-5)
    k_before = cache.site_kv(0)[0]
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.site_kv(0)[0], k_before.flip(0))


def test_quantize_sites_casts_to_the_dtype_the_objective_asks_for():
    """The fine-tuning objective calls ``quantize_sites(..., dtype=)`` on whatever quantizer it is given;
    a baseline gives the same values cast once, and the objective runs on it without ``quantized=``."""
    model = make_tiny_ouro().eval()
    q = make_baseline("kivi2", model.kv_layout(), group=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    fp = teacher(model, ids)
    keys, values = q.quantize_sites(fp.keys, fp.values)
    keys16, values16 = q.quantize_sites(fp.keys, fp.values, dtype=torch.bfloat16)
    assert set(keys16) == set(keys) == set(fp.keys) and set(values16) == set(values)
    for got, want in [(keys16[s], keys[s]) for s in keys] + [(values16[s], values[s]) for s in values]:
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert not torch.equal(keys[0], fp.keys[0])  # 2-bit codes: the values did change
    logits = quantized_logits(model, ids, q, fp=fp, sink_tokens=2)
    torch.testing.assert_close(logits, quantized_logits(model, ids, q, fp=fp, sink_tokens=2, quantized=(keys, values)))
