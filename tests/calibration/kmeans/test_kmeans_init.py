"""Weighted k-means initialisation: k-means++ (torch and fused Triton) and random init against their rules (only
positive-weight points, deterministic per seed, spread over separated clusters), the weighted draw, trusted weights.
The Triton cases run on a GPU, or on CPU in Triton's interpreter (TRITON_INTERPRET=1 with triton installed);
otherwise they are skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as TRITON_DEVICE, needs_triton_kernels as needs_triton
from support.builders import blobs, np_assign
from support.kmeans import K, gen

from loopvq_calib.calibration.kmeans.seeding import _draw_one, kmeans_pp_init, random_init


def fused_pp(x: torch.Tensor, w: torch.Tensor, k: int, *, generator: torch.Generator) -> torch.Tensor:
    return kmeans_pp_init(x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), k, generator=generator, fused=True).cpu()


INITS = [kmeans_pp_init, random_init, pytest.param(fused_pp, marks=needs_triton)]
PP_INITS = [kmeans_pp_init, pytest.param(fused_pp, marks=needs_triton)]


@pytest.mark.parametrize("init", INITS)
def test_init_picks_only_positive_weight_points(init):
    """With exactly k positive weights, both inits must return those k points (zero weight: never drawn)."""
    x, w = blobs(3, 200, 4, 5, seed=1)
    w = torch.zeros_like(w)
    chosen = torch.stack([torch.randperm(200, generator=gen(p))[:K] for p in range(3)])
    w.scatter_(1, chosen, torch.rand(3, K, generator=gen(9)) + 0.1)
    c = init(x, w, K, generator=gen(0))
    for p in range(3):
        expect = {tuple(v) for v in x[p, chosen[p]].tolist()}
        assert {tuple(v) for v in c[p].tolist()} == expect


@pytest.mark.parametrize("init", INITS)
def test_init_is_deterministic_for_a_seed(init):
    x, w = blobs(4, 300, 4, 8, seed=2)
    a, b, other = init(x, w, K, generator=gen(5)), init(x, w, K, generator=gen(5)), init(x, w, K, generator=gen(6))
    assert torch.equal(a, b) and not torch.equal(a, other)
    rows = [{tuple(v) for v in x[p].tolist()} for p in range(4)]
    assert all(tuple(v) in rows[p] for p in range(4) for v in a[p].tolist())  # centroids are data points
    assert all(len({tuple(v) for v in a[p].tolist()}) == K for p in range(4))  # distinct


@pytest.mark.parametrize("init", PP_INITS)
def test_kmeans_pp_spreads_over_separated_clusters(init):
    """D^2 sampling on K tight, far-apart clusters puts one centroid in each (misses have odds ~1e-6)."""
    centres = torch.randn(6, K, 4, generator=gen(3)) * 300
    label = torch.arange(400).remainder(K).expand(6, -1)
    x = centres.gather(1, label[..., None].expand(-1, -1, 4)) + 0.1 * torch.randn(6, 400, 4, generator=gen(4))
    c = init(x, torch.rand(6, 400, generator=gen(5)) + 0.1, K, generator=gen(0))
    for p in range(6):
        assert len(set(np_assign(c[p].double().numpy(), centres[p].double().numpy()).tolist())) == K


def test_draw_matches_the_distribution():
    """Frequencies of 200,000 draws equal prob / sum within 4 standard errors; zero-probability entries
    (incl. a zero run and the ends, u = 0 and u near 1) are never drawn."""
    prob = torch.zeros(1, 3 * 8)
    prob[0, [1, 7, 16, 23]] = torch.tensor([1.0, 3.0, 2.0, 2.0])  # entries 8..15 have no mass
    n = 200_000
    u = torch.cat(
        [torch.rand(n - 2, dtype=torch.float64, generator=gen(0)), torch.tensor([0.0, 1 - 1e-16], dtype=torch.float64)]
    )
    idx = _draw_one(prob.expand(n, -1).contiguous(), prob.expand(n, -1).contiguous(), u)
    freq = torch.bincount(idx, minlength=24).double() / n
    expect = (prob[0] / prob.sum()).double()
    assert freq[expect == 0].sum() == 0
    se = (expect * (1 - expect) / n).sqrt()
    assert ((freq - expect).abs() <= 4 * se + 1e-12).all(), (freq, expect)


def test_draw_falls_back_when_a_row_has_no_mass():
    """A row whose probabilities are all zero draws from the fallback (here: only entry 5)."""
    prob = torch.zeros(4, 16)
    prob[1, 9] = 1.0
    fallback = torch.zeros(4, 16)
    fallback[:, 5] = 2.0
    idx = _draw_one(prob, fallback, torch.rand(4, dtype=torch.float64, generator=gen(1)))
    assert idx.tolist() == [5, 9, 5, 5]


@pytest.mark.parametrize("init", PP_INITS)
def test_kmeans_pp_never_seeds_on_zero_weight_points_when_positive_ones_run_out(init):
    """3 positive-weight points at 2 locations, K 5: once every w D^2 is 0 the draws fall back to ~ w,
    so every centroid is one of the 2 locations and no zero-weight point is chosen."""
    x = torch.randn(1, 40, 4, generator=gen(7))
    x[0, 1] = x[0, 0]
    w = torch.zeros(1, 40)
    w[0, :3] = torch.tensor([1.0, 2.0, 0.5])
    c = init(x, w, 5, generator=gen(8))[0]
    allowed = {tuple(x[0, 0].tolist()), tuple(x[0, 2].tolist())}
    assert {tuple(v) for v in c.tolist()} == allowed


def test_trusted_weights_skip_only_the_check_that_waits_for_the_device():
    """``kmeans_pp_init(trusted_weights=True)`` draws the same centroids; only the weights' value check (a host
    sync on a GPU) is left out, the shape checks stay."""
    x, w = torch.randn(3, 40, 4, generator=gen(11)), torch.rand(3, 40, generator=gen(12))
    assert torch.equal(
        kmeans_pp_init(x, w, 5, generator=gen(13)), kmeans_pp_init(x, w, 5, generator=gen(13), trusted_weights=True)
    )
    with pytest.raises(ValueError, match="weights must be >= 0"):
        kmeans_pp_init(x, -w, 5, generator=gen(13))
    with pytest.raises(ValueError, match="cannot seed 50 distinct centroids"):
        kmeans_pp_init(x, w, 50, generator=gen(13), trusted_weights=True)


@pytest.mark.gpu
def test_fused_seeding_of_trusted_weights_queues_behind_running_work():
    """On the fit path nothing waits for the device: the fused draws return while earlier work still runs."""
    x = torch.randn(4, 300, 16, generator=gen(14)).cuda()
    w = torch.rand(4, 300, generator=gen(15)).cuda()
    kmeans_pp_init(x, w, 8, generator=gen(16), fused=True, trusted_weights=True)  # compiled before the timing below
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)
    init = kmeans_pp_init(x, w, 8, generator=gen(16), fused=True, trusted_weights=True)
    assert not torch.cuda.current_stream().query()
    assert torch.equal(init.cpu(), kmeans_pp_init(x, w, 8, generator=gen(16), fused=True).cpu())
