"""TaSQ's query statistics and channel weights (tasq_stats.py) against brute force with explicit RoPE
matrices."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.calibration.tasq.stats import QueryStats, channel_weights
from loopvq_calib.models.sites import KVLayout


def rope_matrices(positions: torch.Tensor, d: int, theta: float, style: str) -> torch.Tensor:
    """Explicit RoPE rotations R_p [S, D, D] (float64): pair (a, b) -> (a cos - b sin, b cos + a sin)."""
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    r = torch.zeros(len(positions), d, d, dtype=torch.float64)
    for k in range(d // 2):
        a, b = (k, k + d // 2) if style == "half" else (2 * k, 2 * k + 1)
        ang = positions.double() * freq[k]
        r[:, a, a], r[:, a, b], r[:, b, a], r[:, b, b] = ang.cos(), -ang.sin(), ang.sin(), ang.cos()
    return r


def brute_query_stats(
    q: torch.Tensor, positions: torch.Tensor, kv_heads: int, theta: float, style: str
) -> torch.Tensor:
    """Sum over causal pairs (i >= j) of diag(R_j^T q_i q_i^T R_j), post-RoPE q_i; GQA heads averaged -> [B, Hkv, D]."""
    b, s, hq, d = q.shape
    r = rope_matrices(positions, d, theta, style)
    qr = torch.einsum("ide,bihe->bihd", r, q.double())  # post-RoPE queries
    eff = torch.einsum("jed,bihe->bijhd", r, qr)  # R_j^T q_i
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, :, :, None, None]
    total = (eff.pow(2) * causal).sum((1, 2))
    return total.view(b, kv_heads, hq // kv_heads, d).mean(2)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_query_stats_equal_brute_force(style):
    torch.manual_seed(0)
    kv = KVLayout("t", (), 1, 2, 8, style, 100.0)
    q = torch.randn(2, 9, 4, 8)  # GQA: 4 query heads on 2 KV heads
    positions = (torch.arange(9) + 3)[None].expand(2, -1)
    stats = QueryStats(kv)
    stats(5, q, positions)
    want = brute_query_stats(q, positions[0], 2, 100.0, style)
    torch.testing.assert_close(stats.sums[5].double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_reader_query_stats_equal_brute_force_over_model_queries(tiny_captures, name):
    model, kv, calib, reader = tiny_captures[name]
    seen = {}
    model.query_observer = lambda site, q, pos: seen.setdefault(site, (q.detach().clone(), pos[0].clone()))
    try:
        with torch.no_grad():
            model(calib.input_ids, use_cache=False)
    finally:
        model.query_observer = None
    s = calib.input_ids.shape[1]
    for site in (kv.sites[0].site, kv.sites[-1].site):
        q, pos = seen[site]
        want = brute_query_stats(q, pos, kv.kv_heads, kv.rope_theta, kv.rope_style).mean(0) / (s * (s + 1) / 2)
        torch.testing.assert_close(reader.query_stats(site).double(), want, rtol=1e-4, atol=1e-7)


def test_channel_weights_mean_square_and_floor():
    diag = torch.tensor([[4.0, 1.0, 0.0, 1e-9], [2.0, 2.0, 2.0, 2.0]])
    w = channel_weights(diag, 1e-3)
    floored = torch.tensor([[4.0, 1.0, 4e-3, 4e-3], [2.0, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(w, (floored / floored.mean(-1, keepdim=True)).sqrt())
    torch.testing.assert_close(w.pow(2).mean(-1), torch.ones(2))
    assert w[0, 2] == w[0, 3] > 0
    with pytest.raises(ValueError):
        channel_weights(torch.zeros(1, 4), 1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sums_stay_on_the_queries_device_until_moved_together(device):
    """Per site the sums stay where the queries are (no host copy inside the forward); ``on_host`` gives every
    site's sums on the CPU, equal to the brute force."""
    torch.manual_seed(1)
    kv = KVLayout("t", (), 1, 2, 8, "half", 100.0)
    positions = torch.arange(7)[None].expand(3, -1)
    qs = {site: torch.randn(3, 7, 2, 8) for site in (0, 4, 9)}
    stats = QueryStats(kv)
    assert stats.on_host() == {}
    for site, q in qs.items():
        stats(site, q.to(device), positions.to(device))
    assert all(v.device.type == device for v in stats.sums.values())
    host = stats.on_host()
    assert list(host) == [0, 4, 9] and all(v.device.type == "cpu" for v in host.values())
    for site, q in qs.items():
        want = brute_query_stats(q, positions[0], 2, 100.0, "half")
        torch.testing.assert_close(host[site].double(), want, rtol=1e-4, atol=1e-5)
