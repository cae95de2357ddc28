"""Weighted k-means backends: the Lloyd backends (torch, fused Triton, faiss) against float64 numpy references,
empty clusters reseeded, problems of several layouts in one call, CPU threads and devices (the init:
test_kmeans_init.py; which backend runs: test_kmeans_select.py). The Triton cases run on a GPU, or on CPU in
Triton's interpreter (TRITON_INTERPRET=1 with triton installed); otherwise they are skipped."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from conftest import KERNEL_DEVICE as TRITON_DEVICE, needs_triton_kernels as needs_triton
from support.builders import CPU, blobs, np_assign
from support.kmeans import G, K, gen, needs_faiss

from loopvq_calib.calibration.kmeans import seeding, solvers as kmeans_backends
from loopvq_calib.calibration.kmeans.seeding import kmeans_pp_init, random_init
from loopvq_calib.calibration.kmeans.solvers import _reseed, weighted_kmeans
from loopvq_calib.config.schema import KMeansConfig
from loopvq_calib.kernels.backends import DISPATCH

LLOYD = [
    pytest.param({"backend": "torch", "device": CPU}, id="torch"),
    pytest.param({"backend": "triton", "device": TRITON_DEVICE}, id="triton", marks=needs_triton),
]


# ---------- independent references ----------


def np_objective(x: np.ndarray, w: np.ndarray, c: np.ndarray) -> float:
    d = ((x[:, None, :] - c[None]) ** 2).sum(-1).min(-1)
    return float((w * d).sum() / w.sum())


def np_lloyd(x: np.ndarray, w: np.ndarray, c: np.ndarray, iterations: int, tolerance: float) -> tuple[np.ndarray, int]:
    """Weighted Lloyd (no empty clusters expected): stop when the mean |centroid change| < tolerance."""
    x, w, c = x.astype(np.float64), w.astype(np.float64), c.astype(np.float64)
    for it in range(1, iterations + 1):
        a = np_assign(x, c)
        new = c.copy()
        for r in range(len(c)):
            m = a == r
            assert w[m].sum() > 0, "reference expects no empty cluster"
            new[r] = (w[m, None] * x[m]).sum(0) / w[m].sum()
        change = np.abs(new - c).mean()
        c = new
        if change < tolerance:
            return c, it
    return c, iterations


# ---------- Lloyd ----------


@pytest.mark.parametrize("backend", LLOYD)
def test_lloyd_matches_numpy_reference(backend):
    """Weighted update, iteration count under the tolerance stop, and both objectives vs numpy."""
    x, w = blobs(5, 600, 4, 6, seed=4)
    init = kmeans_pp_init(x, w, 6, generator=gen(1))
    cfg = KMeansConfig(iterations=30, tolerance=1e-3, points_per_chunk=97, problems_per_batch=2)
    res = weighted_kmeans(x, w, init, cfg=cfg, **backend)
    for p in range(5):
        xp, wp, cp = x[p].double().numpy(), w[p].double().numpy(), init[p].double().numpy()
        ref, its = np_lloyd(xp, wp, cp, cfg.iterations, cfg.tolerance)
        assert res.iterations[p] == its
        np.testing.assert_allclose(res.centroids[p].numpy(), ref, atol=1e-4)
        assert res.objective_init[p] == pytest.approx(np_objective(xp, wp, cp), rel=1e-4)
        assert res.objective_final[p] == pytest.approx(np_objective(xp, wp, ref), rel=1e-4)
    assert (res.objective_final <= res.objective_init).all() and len(set(res.iterations.tolist())) > 1


@pytest.mark.parametrize("backend", LLOYD)
def test_one_update_is_the_weighted_mean(backend):
    x, w = blobs(2, 500, 4, 8, seed=5)
    init = random_init(x, w, 8, generator=gen(2))
    res = weighted_kmeans(x, w, init, cfg=KMeansConfig(iterations=1, tolerance=0), **backend)
    for p in range(2):
        xp, wp = x[p].double().numpy(), w[p].double().numpy()
        a = np_assign(xp, init[p].double().numpy())
        ref = np.stack([(wp[a == r, None] * xp[a == r]).sum(0) / wp[a == r].sum() for r in range(8)])
        np.testing.assert_allclose(res.centroids[p].numpy(), ref, atol=1e-5)
    assert res.iterations.tolist() == [1, 1]


@needs_faiss
@pytest.mark.parametrize("n", [900, 256 * 4 + 700])  # the second exceeds faiss's default 256 points per centroid
def test_faiss_and_torch_agree(n):
    k = 4 if n > 1000 else K
    x, w = blobs(3, n, G, k, seed=6)
    init = kmeans_pp_init(x, w, k, generator=gen(3))
    cfg = KMeansConfig(iterations=8, tolerance=0.0)
    a = weighted_kmeans(x, w, init, cfg=cfg, backend="torch", device=CPU)
    b = weighted_kmeans(x, w, init, cfg=cfg, backend="faiss", device=CPU)
    assert a.empty_clusters.sum() == 0 and b.empty_clusters.sum() == 0
    torch.testing.assert_close(a.centroids, b.centroids, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.objective_final, b.objective_final, rtol=1e-5, atol=0)
    assert b.iterations.tolist() == [8, 8, 8]
    if n > 256 * k:  # faiss with its defaults subsamples and lands elsewhere: the comparison can see it
        import faiss

        km = faiss.Kmeans(G, k, niter=8, seed=0, verbose=False)
        km.train(x[0].numpy(), weights=w[0].numpy(), init_centroids=init[0].numpy())
        assert not np.allclose(km.centroids, a.centroids[0].numpy(), atol=1e-4)


@needs_faiss
def test_cpu_search_through_faiss_equals_the_chunked_torch_search(monkeypatch):
    """On the CPU the torch backend finds nearest centroids with faiss.knn when faiss is installed; the chunked
    baddbmm search (no faiss, and every GPU) must give the same Lloyd run, reseeded empty clusters included."""
    x, w = blobs(4, 700, G, K, seed=13)
    init = kmeans_pp_init(x, w, K, generator=gen(7))
    init[:, 0] = 1e3
    cfg = KMeansConfig(iterations=40, tolerance=1e-4, points_per_chunk=100, problems_per_batch=3)
    with_faiss = weighted_kmeans(x, w, init, cfg=cfg, backend="torch", device=CPU)
    monkeypatch.setattr(kmeans_backends, "_faiss_search", lambda: None)
    chunked = weighted_kmeans(x, w, init, cfg=cfg, backend="torch", device=CPU)
    torch.testing.assert_close(with_faiss.centroids, chunked.centroids, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_faiss.objective_final, chunked.objective_final)
    assert torch.equal(with_faiss.iterations, chunked.iterations) and len(set(chunked.iterations.tolist())) > 1
    assert with_faiss.empty_clusters.tolist() == chunked.empty_clusters.tolist() == [1, 1, 1, 1]


def test_cpu_problems_spread_over_threads_equal_one_sequential_batch(monkeypatch):
    """On the CPU, k-means++ runs in blocks of CPU_BLOCK problems and Lloyd in blocks of problems_per_batch, the
    blocks spread over torch.get_num_threads() single-threaded workers: the same seeds and centroids as all
    problems in one batch on the calling thread, and the thread settings are restored afterwards."""
    x, w = blobs(11, 300, G, K, seed=21)
    init = kmeans_pp_init(x, w, K, generator=gen(4))
    uniforms = torch.rand(K, 11, generator=gen(4), dtype=torch.float64)  # the draws kmeans_pp_init makes
    assert torch.equal(init, seeding._kmeans_pp_rows(x, w, K, uniforms=uniforms))
    whole = weighted_kmeans(
        x, w, init, cfg=KMeansConfig(iterations=12, tolerance=1e-4, problems_per_batch=11), backend="torch", device=CPU
    )
    seen = []
    real_lloyd = kmeans_backends._lloyd

    def spy(xb, *args, **kwargs):
        seen.append((xb.shape[0], torch.get_num_threads()))
        return real_lloyd(xb, *args, **kwargs)

    monkeypatch.setattr(kmeans_backends, "_lloyd", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        blocks = weighted_kmeans(
            x,
            w,
            init,
            cfg=KMeansConfig(iterations=12, tolerance=1e-4, problems_per_batch=3),
            backend="torch",
            device=CPU,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert sorted(seen) == [(2, 1), (3, 1), (3, 1), (3, 1)]  # four blocks, each on a single-threaded worker
    for field in ("centroids", "objective_init", "objective_final", "iterations", "empty_clusters"):
        assert torch.equal(getattr(blocks, field), getattr(whole, field)), field
    assert len(set(whole.iterations.tolist())) > 1  # problems stop at different updates


@pytest.mark.parametrize(
    "backend", LLOYD + [pytest.param({"backend": "faiss", "device": CPU}, id="faiss", marks=needs_faiss)]
)
def test_zero_weight_points_do_not_move_centroids(backend):
    x, w = blobs(2, 400, 4, 6, seed=7)
    outliers = torch.randn(2, 50, 4, generator=gen(8)) * 5 + 20
    x_all, w_all = torch.cat([x, outliers], 1), torch.cat([w, torch.zeros(2, 50)], 1)
    init = kmeans_pp_init(x, w, 6, generator=gen(4))
    cfg = KMeansConfig(iterations=10, tolerance=0.0)
    with_outliers = weighted_kmeans(x_all, w_all, init, cfg=cfg, **backend)
    without = weighted_kmeans(x, w, init, cfg=cfg, **backend)
    torch.testing.assert_close(with_outliers.centroids, without.centroids, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_outliers.objective_final, without.objective_final)


@pytest.mark.parametrize("backend", LLOYD)
def test_empty_clusters_are_reseeded_deterministically(backend):
    x, w = blobs(3, 300, 4, 4, seed=9)
    w[:, :10] = 0.0
    init = kmeans_pp_init(x, w, 4, generator=gen(5))
    init[:, 0] = 1e3  # no point is nearest to centroid 0: it is empty in the first update
    cfg = KMeansConfig(iterations=1, tolerance=0.0, seed=11)
    res = weighted_kmeans(x, w, init, cfg=cfg, **backend)
    assert res.empty_clusters.tolist() == [1, 1, 1]
    for p in range(3):
        positive = {tuple(v) for v in x[p, 10:].tolist()}
        assert tuple(res.centroids[p, 0].tolist()) in positive
    again = weighted_kmeans(
        x, w, init, cfg=KMeansConfig(iterations=1, tolerance=0.0, seed=11, problems_per_batch=1), **backend
    )
    assert torch.equal(res.centroids[:, 0], again.centroids[:, 0])  # same seed, any batching: same reseeded point
    torch.testing.assert_close(res.centroids, again.centroids)  # (GPU atomic adds may differ in the last bits)
    other = weighted_kmeans(x, w, init, cfg=KMeansConfig(iterations=1, tolerance=0.0, seed=12), **backend)
    assert not torch.equal(res.centroids[:, 0], other.centroids[:, 0])
    full = weighted_kmeans(x, w, init, cfg=KMeansConfig(iterations=20, tolerance=0.0), **backend)
    assert (full.objective_final < full.objective_init).all()


@pytest.mark.parametrize("backend", LLOYD)
def test_problems_of_two_layouts_solved_together_keep_their_own_reseeding(backend):
    """problem_keys: two sets of problems (two layouts, seeds 11 and 12) joined in one call give what each
    gives alone, reseeded empty clusters included (their draws are keyed by (seed, problem), not by the row)."""
    x, w = blobs(4, 300, 4, 4, seed=9)
    init = kmeans_pp_init(x, w, 4, generator=gen(5))
    init[:, 0] = 1e3  # centroid 0 is empty in the first update of every problem: all are reseeded
    cfg = KMeansConfig(iterations=3, tolerance=0.0)
    a = weighted_kmeans(x[:2], w[:2], init[:2], cfg=cfg, **backend, seed=11)
    b = weighted_kmeans(x[2:], w[2:], init[2:], cfg=cfg, **backend, seed=12)
    keys = [(11, 0), (11, 1), (12, 0), (12, 1)]
    joined = weighted_kmeans(x, w, init, cfg=cfg, **backend, problem_keys=keys)
    assert joined.empty_clusters.tolist() == [1, 1, 1, 1] and joined.iterations.tolist() == [3, 3, 3, 3]
    torch.testing.assert_close(joined.centroids, torch.cat([a.centroids, b.centroids]))  # (GPU atomic adds: last bits)
    first = KMeansConfig(iterations=1, tolerance=0.0)  # after the first update centroid 0 is the reseeded point itself
    alone = [
        weighted_kmeans(x[s], w[s], init[s], cfg=first, **backend, seed=seed).centroids[:, 0]
        for s, seed in ((slice(0, 2), 11), (slice(2, 4), 12))
    ]
    assert torch.equal(
        weighted_kmeans(x, w, init, cfg=first, **backend, problem_keys=keys).centroids[:, 0], torch.cat(alone)
    )
    torch.testing.assert_close(joined.objective_final, torch.cat([a.objective_final, b.objective_final]))
    unkeyed = weighted_kmeans(
        x, w, init, cfg=cfg, **backend, seed=11
    )  # rows 2, 3 would draw as problems (11, 2), (11, 3)
    assert not torch.equal(unkeyed.centroids[2:, 0], b.centroids[:, 0])
    with pytest.raises(ValueError, match="3 problem keys for 4 problems"):
        weighted_kmeans(x, w, init, cfg=cfg, **backend, problem_keys=keys[:3])


def test_reseed_maps_batch_rows_to_their_problems():
    """Row q of the centroids belongs to problem rows[q]: an empty slot is refilled with a positive-weight
    point of that problem, drawn by the generator of keys[q], and nothing else moves."""
    x = torch.arange(4 * 6 * 2, dtype=torch.float32).view(4, 6, 2)  # every point distinct across problems
    w = torch.ones(4, 6)
    w[3, :4] = 0.0  # problem 3: only points 4 and 5 may be drawn
    c = torch.full((2, 3, 2), -1.0)
    empty = torch.tensor([[False, True, False], [True, False, True]])
    _reseed(c, empty, x, w=w, rows=[1, 3], keys=[(7, 1, 2), (7, 3, 2)])
    assert (c[~empty] == -1).all()
    assert tuple(c[0, 1].tolist()) in {tuple(v) for v in x[1].tolist()}
    assert {tuple(c[1, 0].tolist()), tuple(c[1, 2].tolist())} == {tuple(x[3, 4].tolist()), tuple(x[3, 5].tolist())}
    again = torch.full((2, 3, 2), -1.0)
    _reseed(again, empty, x, w=w, rows=[1, 3], keys=[(7, 1, 2), (7, 3, 2)])
    assert torch.equal(c, again)


@needs_faiss
def test_faiss_runs_where_kmeans_device_says(monkeypatch, caplog):
    """faiss.Kmeans is asked for its GPUs only for a CUDA ``kmeans.device`` and a faiss that has GPUs; a CUDA
    device with a faiss without GPU support runs on the CPU and says so."""
    import faiss

    x, w = blobs(2, 300, 4, 4, seed=14)
    init = kmeans_pp_init(x, w, 4, generator=gen(9))
    cfg = KMeansConfig(iterations=5, tolerance=0.0)
    reference = weighted_kmeans(x, w, init, cfg=cfg, backend="faiss", device=CPU)
    asked, real = [], faiss.Kmeans
    monkeypatch.setattr(faiss, "Kmeans", lambda *args, **kw: asked.append(kw["gpu"]) or real(*args, **kw))
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)  # faiss-gpu with a visible GPU
    torch.testing.assert_close(
        weighted_kmeans(x, w, init, cfg=cfg, backend="faiss", device=CPU).centroids, reference.centroids
    )
    assert asked == [False, False]
    weighted_kmeans(
        x, w, init, cfg=cfg, backend="faiss", device=torch.device("cuda")
    )  # (this faiss-cpu then runs on the CPU)
    assert asked[2:] == [True, True]
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0)
    DISPATCH.clear()  # the note is given once per process
    monkeypatch.setattr(logging.getLogger("loopvq_calib"), "propagate", True)
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        on_cuda = weighted_kmeans(x, w, init, cfg=cfg, backend="faiss", device=torch.device("cuda"))
    torch.testing.assert_close(on_cuda.centroids, reference.centroids)
    assert "this faiss has no GPU support (faiss-cpu); k-means runs on the CPU, not cuda" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_backends_match_cpu(backend):
    x, w = blobs(6, 3000, G, K, seed=12)
    w[:, :100] = 0.0
    init = kmeans_pp_init(x.cuda(), w.cuda(), K, generator=gen(6))
    assert torch.equal(init.cpu(), kmeans_pp_init(x, w, K, generator=gen(6)))  # same draws on any device
    init[:, 0] = 1e3  # forces a reseed on both devices
    cfg = KMeansConfig(iterations=30, tolerance=1e-6, points_per_chunk=1000, problems_per_batch=4)
    on_gpu = weighted_kmeans(x, w, init.cpu(), cfg=cfg, backend=backend, device=torch.device("cuda"))
    on_cpu = weighted_kmeans(x, w, init.cpu(), cfg=cfg, backend="torch", device=CPU)
    torch.testing.assert_close(on_gpu.centroids, on_cpu.centroids, atol=1e-4, rtol=1e-4)
    assert torch.equal(on_gpu.iterations, on_cpu.iterations) and on_gpu.empty_clusters.sum() >= 6
