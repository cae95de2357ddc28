"""TaSQ stage: weights, sigma, the fitted permutation P, bits and storage (the query statistics they come from:
test_tasq_stats.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from loopvq_calib.calibration.tasq import grouping as tasq
from loopvq_calib.calibration.tasq.grouping import (
    TasqResult,
    block_covariance,
    fit_groups,
    fit_tasq,
    grouping_cost,
    merge_costs,
    merge_tasq,
    min_weight_matching,
    rope_pair_units,
)
from loopvq_calib.codes.codec import BlockCodec, TasqTransform, code_bits, gather_groups, sigma_bits
from loopvq_calib.codes.layouts import BlockLayout, plan_layouts
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import QuantConfig, TasqConfig
from loopvq_calib.config.source import ConfigError
from loopvq_calib.models.sites import KVLayout
from loopvq_calib.runtime.processes import DistContext

METHODS = ("tasq", "tasq+loopvq")
MODELS = ("ouro", "huginn")  # the tiny_captures


# ---------- independent references ----------


def partner(flat: int, d: int, style: str) -> int:
    m, c = divmod(flat, d)
    return m * d + ((c + d // 2) % d if style == "half" else c ^ 1)


def brute_cost(cov: torch.Tensor, groups: torch.Tensor, eps: float) -> float:
    g = groups.shape[-1]
    return sum(float(torch.det(cov[s][:, s] + eps * torch.eye(g, dtype=cov.dtype)) ** (1 / g)) for s in groups)


def greedy_cost(c: torch.Tensor) -> float:
    """Total cost of the cheapest-pair-first matching."""
    n = c.shape[0]
    pairs = sorted((float(c[i, j]), i, j) for i in range(n) for j in range(i + 1, n))
    used, total = set(), 0.0
    for w, i, j in pairs:
        if i not in used and j not in used:
            used |= {i, j}
            total += w
    return total


def perfect_matchings(nodes: list[int]):
    if not nodes:
        yield []
        return
    first, rest = nodes[0], nodes[1:]
    for i, other in enumerate(rest):
        for m in perfect_matchings(rest[:i] + rest[i + 1 :]):
            yield [(first, other)] + m


# ---------- fits of the tiny captures, built once ----------


def quant(method: str, group_size: int = 8) -> QuantConfig:
    return QuantConfig(method=method, group_size=group_size, codebook_size=16, bits=None, steps_per_block=4)


@pytest.fixture(scope="module")
def fits(tiny_captures):
    out = {}
    for name, (_, kv, _, reader) in tiny_captures.items():
        for method in METHODS:
            layouts = plan_layouts(kv, quant(method))
            out[name, method] = (layouts, fit_tasq(reader, layouts, kv, quant=quant(method), cfg=TasqConfig()))
    return out


# ---------- weights and sigma ----------


@pytest.mark.parametrize("name", list(MODELS))
def test_fitted_weights_and_sigma_rule(tiny_captures, fits, name):
    _, kv, _, reader = tiny_captures[name]
    _, res = fits[name, "tasq+loopvq"]
    for lay in res.layouts:
        if lay.kind != "key":
            continue
        t = res.transforms[lay.key]
        assert t.weight.shape == (lay.steps, kv.kv_heads, kv.head_dim) and t.sigma_min == TasqConfig().sigma_min
        for m, site in enumerate(lay.sites):
            d = reader.query_stats(site).double()
            d = torch.maximum(d, 1e-6 * d.amax(-1, keepdim=True))
            torch.testing.assert_close(t.weight[m].double(), (d / d.mean(-1, keepdim=True)).sqrt(), rtol=1e-6, atol=0)
        torch.testing.assert_close(
            t.weight.double().pow(2).mean(-1), torch.ones(lay.steps, kv.kv_heads, dtype=torch.float64)
        )
        x = reader.load("key", lay.sites)
        rms = (x.double() * t.weight.double()).pow(2).mean((-1, -2)).sqrt().clamp_min(1e-4)
        sigma = t.sigma(x)
        assert sigma.dtype == torch.float16 and torch.equal(sigma, rms.to(torch.float16))
        torch.testing.assert_close(t.inverse(t.forward(x, sigma), sigma), x, rtol=1e-6, atol=1e-6)


def test_codec_round_trip_with_exact_codebook(tiny_captures, fits):
    _, kv, _, reader = tiny_captures["ouro"]
    _, res = fits["ouro", "tasq+loopvq"]
    lay = next(l for l in res.layouts if l.kind == "key")
    t = res.transforms[lay.key]
    x = reader.load("key", lay.sites)[:16]
    z = gather_groups(t.forward(x, t.sigma(x)), lay.groups)  # [16, H, n, G]
    codec = BlockCodec(lay, z.permute(1, 2, 0, 3).contiguous(), t)  # codeword k = token k's group vector
    codes = codec.encode(x)
    assert torch.equal(codes.indices.long(), torch.arange(16)[:, None, None].expand_as(codes.indices))
    torch.testing.assert_close(codec.decode(codes), x, rtol=1e-5, atol=1e-6)


# ---------- the permutation P ----------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(MODELS))
def test_fitted_groups_keep_rope_pairs_and_partition(tiny_captures, fits, name, method):
    _, kv, _, _ = tiny_captures[name]
    planned, res = fits[name, method]
    assert [l.key for l in res.layouts] == [l.key for l in planned]
    assert set(res.transforms) == {l.key for l in planned if l.kind == "key"}
    for old, lay in zip(planned, res.layouts):
        if lay.kind == "value":
            assert torch.equal(lay.groups, old.groups)
            continue
        td = lay.steps * kv.head_dim
        assert lay.groups.shape == (kv.kv_heads, td // 8, 8)
        lay.check()
        for h, g in itertools.product(range(kv.kv_heads), range(lay.num_groups)):
            members = set(lay.groups[h, g].tolist())
            assert all(partner(c, kv.head_dim, kv.rope_style) in members for c in members)
        block = res.report["blocks"][lay.key]
        assert block["sites"] == list(lay.sites) and block["tokens"] == 3 * 60
        assert all(a > 0 and b > 0 for a, b in zip(block["cost_before"], block["cost_after"]))
    steps = {l.steps for l in res.layouts}
    assert steps == ({1} if method == "tasq" else ({4} if name == "ouro" else {1, 4}))


def test_report_cost_equals_independent_covariance(tiny_captures, fits):
    _, kv, _, reader = tiny_captures["huginn"]
    _, res = fits["huginn", "tasq+loopvq"]
    lay = next(l for l in res.layouts if l.kind == "key" and l.steps == 4)
    t = res.transforms[lay.key]
    x = reader.load("key", lay.sites).double()
    y = x * t.weight.double() / t.sigma(x.float()).double()[..., None, None]
    for h in range(kv.kv_heads):
        cov = torch.cov(y[:, :, h].reshape(len(y), -1).T, correction=0)
        assert math.isclose(
            res.report["blocks"][lay.key]["cost_after"][h], brute_cost(cov, lay.groups[h], 1e-6), rel_tol=1e-6
        )


def planted(group_size: int, steps: int = 2, d: int = 8, n: int = 4000) -> tuple[torch.Tensor, torch.Tensor]:
    """Covariance where random sets of G/2 RoPE-pair units (across steps) share one latent; -> (cov, groups)."""
    gen = torch.Generator().manual_seed(0)
    units = rope_pair_units(d, steps, "half")
    sets = torch.randperm(len(units), generator=gen).view(-1, group_size // 2)
    y = torch.zeros(n, steps * d, dtype=torch.float64)
    for s in sets:
        latent = torch.randn(n, 2, generator=gen, dtype=torch.float64)
        for u in s:
            scale = 0.5 + torch.rand(1, generator=gen, dtype=torch.float64)
            y[:, units[u]] = latent * scale + 0.05 * torch.randn(n, 2, generator=gen, dtype=torch.float64)
    groups = units[sets].flatten(1).sort(-1).values
    return torch.cov(y.T, correction=0), groups[groups[:, 0].argsort()]


@pytest.mark.parametrize("group_size", [4, 8])
def test_planted_correlated_units_are_grouped(group_size):
    cov, want = planted(group_size)
    got = fit_groups(cov, rope_pair_units(8, 2, "half"), group_size, eps=1e-6)
    assert torch.equal(got, want)
    identity = torch.arange(16).view(-1, group_size)
    assert grouping_cost(cov, got, 1e-6) < 0.5 * grouping_cost(cov, identity, 1e-6)
    assert math.isclose(grouping_cost(cov, got, 1e-6), brute_cost(cov, got, 1e-6), rel_tol=1e-6)
    if group_size == 4:  # 105 perfect matchings of the 8 units: P is the exact optimum
        units = rope_pair_units(8, 2, "half")
        best = min(
            brute_cost(cov, torch.stack([torch.cat([units[a], units[b]]) for a, b in m]), 1e-6)
            for m in perfect_matchings(list(range(8)))
        )
        assert math.isclose(grouping_cost(cov, got, 1e-6), best, rel_tol=1e-9)


def test_matching_two_opt_repairs_greedy_choice():
    inf = float("inf")
    cost = torch.tensor(
        [[inf, 0.0, 1.0, 5.0], [0.0, inf, 5.0, 1.0], [1.0, 5.0, inf, 10.0], [5.0, 1.0, 10.0, inf]], dtype=torch.float64
    )  # greedy takes (0,1) then (2,3): 10; optimum (0,2) (1,3): 2
    a, b = min_weight_matching(cost)
    assert sorted(tuple(sorted(e)) for e in zip(a.tolist(), b.tolist())) == [(0, 2), (1, 3)]


def test_matching_is_perfect_and_two_opt_optimal():
    gen = torch.Generator().manual_seed(3)
    for n in (2, 6, 8, 12):
        c = torch.rand(n, n, generator=gen, dtype=torch.float64)
        c = c + c.T
        c.fill_diagonal_(float("inf"))
        a, b = min_weight_matching(c)
        edges = list(zip(a.tolist(), b.tolist()))
        assert sorted(a.tolist() + b.tolist()) == list(range(n))
        for (p, q), (r, s) in itertools.combinations(edges, 2):  # no re-pairing of two edges is cheaper
            assert c[p, q] + c[r, s] <= min(c[p, r] + c[q, s], c[p, s] + c[q, r]) + 1e-12
        total = sum(float(c[i, j]) for i, j in edges)
        assert total <= greedy_cost(c) + 1e-12
        if n <= 8:
            assert total >= min(sum(float(c[i, j]) for i, j in m) for m in perfect_matchings(list(range(n)))) - 1e-12


def test_a_batch_is_matched_and_fitted_as_one_matrix_at_a_time():
    """Heads fitted at once (in lockstep, each stopping its 2-opt on its own) give each head's own result."""
    gen = torch.Generator().manual_seed(5)
    c = torch.rand(5, 12, 12, generator=gen, dtype=torch.float64)
    c = c + c.transpose(1, 2)
    c.diagonal(dim1=1, dim2=2).fill_(float("inf"))
    a, b = min_weight_matching(c)
    singles = [min_weight_matching(m) for m in c]
    assert torch.equal(a, torch.stack([s[0] for s in singles])) and torch.equal(b, torch.stack([s[1] for s in singles]))
    x = torch.randn(4, 300, 32, generator=gen, dtype=torch.float64) @ torch.randn(
        4, 32, 32, generator=gen, dtype=torch.float64
    )
    cov = x.transpose(1, 2) @ x / 300
    units = rope_pair_units(8, 4, "half")
    fitted = fit_groups(cov, units, 8, eps=1e-6)
    assert fitted.shape == (4, 4, 8)
    assert torch.equal(fitted, torch.stack([fit_groups(m, units, 8, eps=1e-6) for m in cov]))


def test_matching_close_to_exact_blossom_on_captured_keys(tiny_captures, fits):
    nx = pytest.importorskip("networkx")
    _, kv, _, reader = tiny_captures["ouro"]
    _, res = fits["ouro", "tasq+loopvq"]
    lay = next(l for l in res.layouts if l.kind == "key")
    cov = block_covariance(reader.load("key", lay.sites), res.transforms[lay.key])[0]
    cost = merge_costs(cov, rope_pair_units(kv.head_dim, lay.steps, kv.rope_style), 1e-6)  # 32 units
    a, b = min_weight_matching(cost)
    graph = nx.Graph()
    graph.add_weighted_edges_from((i, j, float(cost[i, j])) for i, j in itertools.combinations(range(len(cost)), 2))
    exact = sum(float(cost[i, j]) for i, j in nx.min_weight_matching(graph))
    assert exact <= float(cost[a, b].sum()) <= 1.01 * exact


def test_rope_pair_units():
    assert rope_pair_units(4, 2, "half").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rope_pair_units(4, 2, "interleaved").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_unreachable_group_size_is_rejected(tiny_captures):
    cov = torch.eye(24, dtype=torch.float64)
    with pytest.raises(ConfigError, match="quant.group_size"):
        fit_groups(cov, rope_pair_units(24, 1, "half"), 12, eps=1e-6)
    _, kv, _, reader = tiny_captures["ouro"]
    layouts = plan_layouts(kv, quant("tasq+loopvq"))
    with pytest.raises(ConfigError, match="quant.group_size"):
        fit_tasq(reader, layouts, kv, quant=quant("tasq+loopvq", 12), cfg=TasqConfig())
    with pytest.raises(ValueError):
        fit_tasq(reader, plan_layouts(kv, quant("loopvq")), kv, quant=quant("loopvq"), cfg=TasqConfig())


# ---------- bits and storage ----------


def test_bits_accounting(fits):
    assert 8 / 16 + sigma_bits(16, 128) == 8 / 16 + 16 / (16 * 128) == 0.5078125
    assert round(code_bits(256, 16) + sigma_bits(16, 128), 3) == 0.508
    assert round(code_bits(256, 16) + sigma_bits(55, 96), 3) == 0.503
    kv = KVLayout("ouro", (), 4, 16, 128, "half", 1e4)
    lay = BlockLayout("b0.l0", "key", (0,), 128, 16, torch.arange(128).view(1, 8, 16))
    codec = BlockCodec(lay, torch.zeros(16, 8, 256, 16), TasqTransform(torch.ones(1, 16, 128)))
    q = KVQuantizer({lay.key: codec}, "tasq", 256, 16, 1, "none", kv)
    assert q.bits() == {"key": 8 / 16 + 16 / (16 * 128), "value": 0.5}
    _, res = fits["huginn", "tasq"]
    assert res.report["sigma_bits"] == 16 / (4 * 16)


def test_save_load_round_trip(fits, tmp_path):
    _, res = fits["huginn", "tasq+loopvq"]
    res.save(tmp_path / "tasq")
    back = TasqResult.load(tmp_path / "tasq")
    assert back.report == res.report
    assert len(back.layouts) == len(res.layouts)
    for a, b in zip(back.layouts, res.layouts):
        assert (a.name, a.kind, a.sites, a.head_dim, a.kv_heads) == (b.name, b.kind, b.sites, b.head_dim, b.kv_heads)
        assert a.groups.dtype == torch.int64 and torch.equal(a.groups, b.groups)
    assert back.transforms.keys() == res.transforms.keys()
    for k, t in res.transforms.items():
        assert torch.equal(back.transforms[k].weight, t.weight) and back.transforms[k].sigma_min == t.sigma_min


def test_sharded_fit_merges_into_the_single_fit(tiny_captures, fits):
    """fit_tasq on process r of 2 fits only the key layouts i % 2 == r (the others stay as planned, without a
    transform); merge_tasq of the two parts equals the fit in one process."""
    _, kv, _, reader = tiny_captures["ouro"]
    layouts, whole = fits["ouro", "tasq+loopvq"]
    parts = [
        fit_tasq(reader, layouts, kv, quant=quant("tasq+loopvq"), cfg=TasqConfig(), dist=DistContext(r, 2))
        for r in range(2)
    ]
    for r, part in enumerate(parts):
        mine = {lay.key for i, lay in enumerate(layouts) if lay.kind == "key" and i % 2 == r}
        assert set(part.transforms) == set(part.report["blocks"]) == mine
        for i, lay in enumerate(part.layouts):
            if lay.key not in mine:
                assert torch.equal(lay.groups, layouts[i].groups)
    merged = merge_tasq(parts)
    untimed = [{k: v for k, v in r.report.items() if k != "seconds"} for r in (merged, whole)]
    assert untimed[0] == untimed[1] and merged.transforms.keys() == whole.transforms.keys()
    assert merged.report["seconds"] == parts[0].report["seconds"]  # the main process's phases
    assert set(whole.report["seconds"]) == {"query_stats", "load", "covariance", "grouping", "report"}
    assert all(v >= 0 for v in whole.report["seconds"].values())
    for a, b in zip(merged.layouts, whole.layouts):
        assert a.key == b.key and torch.equal(a.groups, b.groups)
    for k, t in whole.transforms.items():
        assert torch.equal(merged.transforms[k].weight, t.weight) and merged.transforms[k].sigma_min == t.sigma_min


@pytest.mark.parametrize("budget", [1, 1 << 30])  # one head per batch | all heads of all layouts in one batch
def test_layouts_fitted_together_equal_one_head_at_a_time(tiny_captures, fits, monkeypatch, budget):
    """fit_tasq stacks the heads of every key layout with the same steps; the groups equal fit_groups of
    each head's own covariance, one at a time, whatever the batch size."""
    _, kv, _, reader = tiny_captures["huginn"]
    layouts, _ = fits["huginn", "tasq+loopvq"]
    monkeypatch.setattr(tasq, "GROUPING_BYTES", budget)
    res = fit_tasq(reader, layouts, kv, quant=quant("tasq+loopvq"), cfg=TasqConfig())
    for lay in (l for l in res.layouts if l.kind == "key"):
        cov = block_covariance(reader.load("key", lay.sites), res.transforms[lay.key])
        units = rope_pair_units(kv.head_dim, lay.steps, kv.rope_style)
        for h in range(kv.kv_heads):
            assert torch.equal(lay.groups[h], fit_groups(cov[h], units, 8, eps=TasqConfig().det_eps))


@pytest.mark.gpu
def test_fit_on_the_gpu_equals_the_cpu_fit(tiny_captures, fits):
    _, kv, _, reader = tiny_captures["ouro"]
    layouts, cpu = fits["ouro", "tasq+loopvq"]
    gpu = fit_tasq(reader, layouts, kv, quant=quant("tasq+loopvq"), cfg=TasqConfig(), device="cuda")
    for a in gpu.layouts:  # float32 products on another device may break a tie otherwise: same quality
        assert a.groups.device.type == "cpu"
        a.check()
    for key, block in cpu.report["blocks"].items():
        assert gpu.report["blocks"][key]["cost_before"] == pytest.approx(block["cost_before"], rel=1e-5)
        assert gpu.report["blocks"][key]["cost_after"] == pytest.approx(block["cost_after"], rel=1e-2)
