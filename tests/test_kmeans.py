"""Weighted k-means: init, both Lloyd backends against numpy references, and the kmeans stage on a real capture."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch
from conftest import make_tiny_ouro
from safetensors.torch import load_file, save_file

from loopvq_calib import kmeans_triton
from loopvq_calib.capture import CaptureReader, capture_kv, write_meta
from loopvq_calib.codec import TasqTransform, gather_groups
from loopvq_calib.config import CaptureConfig, Config, KMeansConfig, QuantConfig, validate
from loopvq_calib.data import CalibrationSet
from loopvq_calib.kmeans import (
    fit_codebooks, kmeans_pp_init, layout_problems, random_init, resolve_backend, weighted_kmeans,
)
from loopvq_calib.layouts import plan_layouts
from loopvq_calib.kmeans_backends import _draw_one

CPU = torch.device("cpu")
K, G = 16, 8
SINKS = 4
HAS_FAISS = importlib.util.find_spec("faiss") is not None
needs_faiss = pytest.mark.skipif(not HAS_FAISS, reason="faiss is not installed")
# the fused Triton kernels run on the GPU, or in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1)
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    not kmeans_triton.available(TRITON_DEVICE), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1"
)
LLOYD = [pytest.param(("torch", CPU), id="torch"), pytest.param(("triton", TRITON_DEVICE), id="triton", marks=needs_triton)]


# ---------- independent references ----------

def np_assign(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Brute-force nearest centroid, float64: x [N, G], c [K, G] -> [N]."""
    return ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(-1)


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


def blobs(p: int, n: int, g: int, k: int, seed: int, spread: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """P problems of N points around k Gaussian centres, with random positive weights."""
    rng = torch.Generator().manual_seed(seed)
    centres = torch.randn(p, k, g, generator=rng) * 3
    label = torch.randint(0, k, (p, n), generator=rng)
    x = centres.gather(1, label[..., None].expand(-1, -1, g)) + spread * torch.randn(p, n, g, generator=rng)
    return x, torch.rand(p, n, generator=rng) + 0.05


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fused_pp(x: torch.Tensor, w: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    return kmeans_pp_init(x.to(TRITON_DEVICE), w.to(TRITON_DEVICE), k, generator, fused=True).cpu()


INITS = [kmeans_pp_init, random_init, pytest.param(fused_pp, marks=needs_triton)]
PP_INITS = [kmeans_pp_init, pytest.param(fused_pp, marks=needs_triton)]


# ---------- init ----------

@pytest.mark.parametrize("init", INITS)
def test_init_picks_only_positive_weight_points(init):
    """With exactly k positive weights, both inits must return those k points (zero weight: never drawn)."""
    x, w = blobs(3, 200, 4, 5, seed=1)
    w = torch.zeros_like(w)
    chosen = torch.stack([torch.randperm(200, generator=gen(p))[:K] for p in range(3)])
    w.scatter_(1, chosen, torch.rand(3, K, generator=gen(9)) + 0.1)
    c = init(x, w, K, gen(0))
    for p in range(3):
        expect = {tuple(v) for v in x[p, chosen[p]].tolist()}
        assert {tuple(v) for v in c[p].tolist()} == expect


@pytest.mark.parametrize("init", INITS)
def test_init_is_deterministic_for_a_seed(init):
    x, w = blobs(4, 300, 4, 8, seed=2)
    a, b, other = init(x, w, K, gen(5)), init(x, w, K, gen(5)), init(x, w, K, gen(6))
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
    c = init(x, torch.rand(6, 400, generator=gen(5)) + 0.1, K, gen(0))
    for p in range(6):
        assert len(set(np_assign(c[p].double().numpy(), centres[p].double().numpy()).tolist())) == K


def test_draw_matches_the_distribution():
    """Frequencies of 200,000 draws equal prob / sum within 4 standard errors; zero-probability entries
    (incl. a zero run and the ends, u = 0 and u near 1) are never drawn."""
    prob = torch.zeros(1, 3 * 8)
    prob[0, [1, 7, 16, 23]] = torch.tensor([1.0, 3.0, 2.0, 2.0])  # entries 8..15 have no mass
    n = 200_000
    u = torch.cat([torch.rand(n - 2, dtype=torch.float64, generator=gen(0)), torch.tensor([0.0, 1 - 1e-16], dtype=torch.float64)])
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
    c = init(x, w, 5, gen(8))[0]
    allowed = {tuple(x[0, 0].tolist()), tuple(x[0, 2].tolist())}
    assert {tuple(v) for v in c.tolist()} == allowed


# ---------- Lloyd ----------

@pytest.mark.parametrize("backend", LLOYD)
def test_lloyd_matches_numpy_reference(backend):
    """Weighted update, iteration count under the tolerance stop, and both objectives vs numpy."""
    x, w = blobs(5, 600, 4, 6, seed=4)
    init = kmeans_pp_init(x, w, 6, gen(1))
    cfg = KMeansConfig(iterations=30, tolerance=1e-3, points_per_chunk=97, problems_per_batch=2)
    res = weighted_kmeans(x, w, init, cfg, *backend)
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
    init = random_init(x, w, 8, gen(2))
    res = weighted_kmeans(x, w, init, KMeansConfig(iterations=1, tolerance=0), *backend)
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
    init = kmeans_pp_init(x, w, k, gen(3))
    cfg = KMeansConfig(iterations=8, tolerance=0.0)
    a = weighted_kmeans(x, w, init, cfg, "torch", CPU)
    b = weighted_kmeans(x, w, init, cfg, "faiss", CPU)
    assert a.empty_clusters.sum() == 0 and b.empty_clusters.sum() == 0
    torch.testing.assert_close(a.centroids, b.centroids, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.objective_final, b.objective_final, rtol=1e-5, atol=0)
    assert b.iterations.tolist() == [8, 8, 8]
    if n > 256 * k:  # faiss with its defaults subsamples and lands elsewhere: the comparison can see it
        import faiss

        km = faiss.Kmeans(G, k, niter=8, seed=0, verbose=False)
        km.train(x[0].numpy(), weights=w[0].numpy(), init_centroids=init[0].numpy())
        assert not np.allclose(km.centroids, a.centroids[0].numpy(), atol=1e-4)


@pytest.mark.parametrize("backend", LLOYD + [pytest.param(("faiss", CPU), id="faiss", marks=needs_faiss)])
def test_zero_weight_points_do_not_move_centroids(backend):
    x, w = blobs(2, 400, 4, 6, seed=7)
    outliers = torch.randn(2, 50, 4, generator=gen(8)) * 5 + 20
    x_all, w_all = torch.cat([x, outliers], 1), torch.cat([w, torch.zeros(2, 50)], 1)
    init = kmeans_pp_init(x, w, 6, gen(4))
    cfg = KMeansConfig(iterations=10, tolerance=0.0)
    with_outliers = weighted_kmeans(x_all, w_all, init, cfg, *backend)
    without = weighted_kmeans(x, w, init, cfg, *backend)
    torch.testing.assert_close(with_outliers.centroids, without.centroids, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_outliers.objective_final, without.objective_final)


@pytest.mark.parametrize("backend", LLOYD)
def test_empty_clusters_are_reseeded_deterministically(backend):
    x, w = blobs(3, 300, 4, 4, seed=9)
    w[:, :10] = 0.0
    init = kmeans_pp_init(x, w, 4, gen(5))
    init[:, 0] = 1e3  # no point is nearest to centroid 0: it is empty in the first update
    cfg = KMeansConfig(iterations=1, tolerance=0.0, seed=11)
    res = weighted_kmeans(x, w, init, cfg, *backend)
    assert res.empty_clusters.tolist() == [1, 1, 1]
    for p in range(3):
        positive = {tuple(v) for v in x[p, 10:].tolist()}
        assert tuple(res.centroids[p, 0].tolist()) in positive
    again = weighted_kmeans(x, w, init, KMeansConfig(iterations=1, tolerance=0.0, seed=11, problems_per_batch=1), *backend)
    assert torch.equal(res.centroids[:, 0], again.centroids[:, 0])  # same seed, any batching: same reseeded point
    torch.testing.assert_close(res.centroids, again.centroids)  # (GPU atomic adds may differ in the last bits)
    other = weighted_kmeans(x, w, init, KMeansConfig(iterations=1, tolerance=0.0, seed=12), *backend)
    assert not torch.equal(res.centroids[:, 0], other.centroids[:, 0])
    full = weighted_kmeans(x, w, init, KMeansConfig(iterations=20, tolerance=0.0), *backend)
    assert (full.objective_final < full.objective_init).all()


def test_backend_resolution_and_missing_faiss(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kmeans_triton, "triton", object())  # installed
    assert resolve_backend("auto", CPU) == "torch" and resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", "cuda:1") == "triton" and resolve_backend("torch", "cuda") == "torch"
    assert resolve_backend("auto", "cuda", 1024) == "triton" and resolve_backend("auto", "cuda", 4096) == "torch"
    with pytest.raises(ValueError, match="kmeans.backend: 'triton' takes codebooks of at most 1024 entries, quant.codebook_size is 4096"):
        resolve_backend("triton", "cuda", 4096)
    with pytest.raises(ValueError, match=r"kmeans.backend: 'triton' needs .* a CUDA device \(kmeans.device is cpu\)"):
        resolve_backend("triton", CPU)
    monkeypatch.setattr(kmeans_triton, "triton", None)  # not installed: auto falls back to torch
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="kmeans.backend: 'triton' needs the triton package"):
        resolve_backend("triton", "cuda")
    assert resolve_backend("faiss", CPU) == "faiss"
    with pytest.raises(ValueError, match="kmeans.backend"):
        resolve_backend("sklearn", CPU)
    monkeypatch.setitem(sys.modules, "faiss", None)
    x, w = blobs(1, 100, 4, 2, seed=10)
    with pytest.raises(ImportError, match="kmeans.backend"):
        weighted_kmeans(x, w, x[:, :K], KMeansConfig(), "faiss", CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_backends_match_cpu(backend):
    x, w = blobs(6, 3000, G, K, seed=12)
    w[:, :100] = 0.0
    init = kmeans_pp_init(x.cuda(), w.cuda(), K, gen(6))
    assert torch.equal(init.cpu(), kmeans_pp_init(x, w, K, gen(6)))  # same draws on any device
    init[:, 0] = 1e3  # forces a reseed on both devices
    cfg = KMeansConfig(iterations=30, tolerance=1e-6, points_per_chunk=1000, problems_per_batch=4)
    on_gpu = weighted_kmeans(x, w, init.cpu(), cfg, backend, torch.device("cuda"))
    on_cpu = weighted_kmeans(x, w, init.cpu(), cfg, "torch", CPU)
    torch.testing.assert_close(on_gpu.centroids, on_cpu.centroids, atol=1e-4, rtol=1e-4)
    assert torch.equal(on_gpu.iterations, on_cpu.iterations) and on_gpu.empty_clusters.sum() >= 6


# ---------- the stage on a real tiny capture ----------

@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory):
    """4 sequences x 32 tokens of a tiny Ouro (2 layers x 4 loops, 4 KV heads of 16): 112 tokens after sinks."""
    model = make_tiny_ouro()
    kv = model.kv_layout()
    ids = torch.randint(0, 4096, (4, 32), generator=gen(0))
    calib = CalibrationSet(input_ids=ids, train=[0, 1, 2], heldout=[3], sink_tokens=SINKS)
    out = tmp_path_factory.mktemp("capture")
    cap = CaptureConfig(dtype="float32")
    capture_kv(model, calib, kv, cap, out)
    write_meta(out, calib, kv, cap)
    return CaptureReader(out), kv


def quant_config(method: str = "loopvq", sharing: str = "none", codebook_size: int = K) -> QuantConfig:
    cfg = Config()
    cfg.quant = QuantConfig(method=method, bits=None, codebook_size=codebook_size, group_size=G, codebook_sharing=sharing)
    cfg.finetune.enabled = False
    return validate(cfg).quant


FAST = KMeansConfig(iterations=25, backend="torch")


def tasq_transforms(layouts, kv) -> dict[str, TasqTransform]:
    out = {}
    for i, lay in enumerate(layouts):
        if lay.kind == "key":
            w = torch.rand(lay.steps, kv.kv_heads, kv.head_dim, generator=gen(i)) + 0.5
            out[lay.key] = TasqTransform(w / w.pow(2).mean(-1, keepdim=True).sqrt())
    return out


@pytest.mark.parametrize("sharing", ["none", "heads", "groups", "all"])
def test_fit_codebooks_shapes_objectives_and_encoding(tiny_capture, sharing):
    reader, kv = tiny_capture
    quant = quant_config(sharing=sharing)
    layouts = plan_layouts(kv, quant)
    calls = []
    q, report = fit_codebooks(reader, layouts, {}, quant, FAST, kv, CPU, progress=calls.append)
    assert calls == [1] * len(layouts) and set(q.codecs) == {lay.key for lay in layouts}
    hc = 1 if sharing in ("heads", "all") else kv.kv_heads
    nc = 1 if sharing in ("groups", "all") else layouts[0].num_groups
    for lay in layouts:
        codec = q.codecs[lay.key]
        assert tuple(codec.codebook.shape) == (hc, nc, K, G) and codec.codebook.dtype == torch.float32
        r = report["layouts"][lay.key]
        assert len(r["objective_init"]) == hc * nc and r["backend"] == "torch"
        assert 0 < r["seconds_init"] < r["seconds"]
        assert all(f <= i + 1e-6 for i, f in zip(r["objective_init"], r["objective_final"]))
        # encoding the calibration data picks the nearest codeword of the codebook its (head, group) uses
        x = reader.load(lay.kind, lay.sites)
        z = gather_groups(x, lay.groups).double().numpy()  # [N, H, n, G]
        idx = codec.encode(x).indices.long().numpy()
        cb = codec.codebook.double().numpy()
        for h in range(kv.kv_heads):
            for g in range(lay.num_groups):
                book = cb[h if hc > 1 else 0, g if nc > 1 else 0]
                d = ((z[:, h, g, None, :] - book[None]) ** 2).sum(-1)
                np.testing.assert_allclose(d[np.arange(len(d)), idx[:, h, g]], d.min(-1), rtol=1e-5, atol=1e-6)
    assert report["totals"]["codebooks"] == len(layouts) * hc * nc
    t = report["totals"]
    assert t["seconds_init"] == pytest.approx(sum(r["seconds_init"] for r in report["layouts"].values()))


def test_fit_codebooks_tasq_encoding_and_cq(tiny_capture):
    """TaSQ keys are clustered in the transformed space (the codec's encode agrees); CQ codes one step per layout."""
    reader, kv = tiny_capture
    quant = quant_config(method="tasq+loopvq")
    layouts = plan_layouts(kv, quant)
    transforms = tasq_transforms(layouts, kv)
    q, _ = fit_codebooks(reader, layouts, transforms, quant, FAST, kv, CPU)
    lay = layouts[0]
    assert lay.kind == "key" and q.codecs[lay.key].transform is transforms[lay.key]
    x = reader.load(lay.kind, lay.sites)
    t = transforms[lay.key]
    z = gather_groups(t.forward(x, t.sigma(x)), lay.groups).double().numpy()
    idx = q.codecs[lay.key].encode(x).indices.long().numpy()
    cb = q.codecs[lay.key].codebook.double().numpy()
    d = ((z[:, :, :, None, :] - cb[None]) ** 2).sum(-1)  # [N, H, n, K]
    chosen = np.take_along_axis(d, idx[..., None], -1)[..., 0]
    np.testing.assert_allclose(chosen, d.min(-1), rtol=1e-5, atol=1e-6)
    cq = quant_config(method="cq")
    cq_layouts = plan_layouts(kv, cq)[:2]
    q_cq, _ = fit_codebooks(reader, cq_layouts, {}, cq, FAST, kv, CPU)
    assert q_cq.steps_per_block == 1 and all(lay.steps == 1 for lay in cq_layouts)
    assert tuple(q_cq.codecs[cq_layouts[0].key].codebook.shape) == (kv.kv_heads, kv.head_dim // G, K, G)


@pytest.mark.parametrize("sharing", ["none", "heads", "groups"])
def test_layout_problems_weights_match_numpy(tiny_capture, sharing):
    """Per-vector weight = sum over the group's coordinates of F * (sigma / w)^2, normalised by the
    problem's maximum; points pool over the shared axis."""
    reader, kv = tiny_capture
    quant = quant_config(method="tasq+loopvq", sharing=sharing)
    lay = plan_layouts(kv, quant)[0]
    t = tasq_transforms([lay], kv)[lay.key]
    x, f = reader.load(lay.kind, lay.sites), reader.load("fisher_" + lay.kind, lay.sites)
    points, weights = layout_problems(x, f, lay, t, K, sharing)
    xn, fn, wn = x.double().numpy(), f.double().numpy(), t.weight.double().numpy()
    sigma = t.sigma(x).double().numpy()  # [N, T]
    y = xn * wn / sigma[..., None, None]
    factor = fn * (sigma[..., None, None] / wn) ** 2
    n, steps, h, d = xn.shape
    flat_y = y.transpose(0, 2, 1, 3).reshape(n, h, steps * d)
    flat_f = factor.transpose(0, 2, 1, 3).reshape(n, h, steps * d)
    groups = lay.groups[0].numpy()
    pts = {(hh, g): (flat_y[:, hh, groups[g]], flat_f[:, hh, groups[g]].sum(-1)) for hh in range(h) for g in range(len(groups))}
    if sharing == "none":
        problems = [[(hh, g)] for hh in range(h) for g in range(len(groups))]
    elif sharing == "heads":
        problems = [[(hh, g) for hh in range(h)] for g in range(len(groups))]
    else:
        problems = [[(hh, g) for g in range(len(groups))] for hh in range(h)]
    assert points.shape == (len(problems), n * len(problems[0]), G)
    for p, members in enumerate(problems):  # the order of points inside a problem is free: match them
        ref_x = np.concatenate([pts[m][0] for m in members])
        ref_w = np.concatenate([pts[m][1] for m in members])
        got_x = points[p].double().numpy()
        match = np_assign(got_x, ref_x)
        assert sorted(match.tolist()) == list(range(len(ref_x)))
        np.testing.assert_allclose(got_x, ref_x[match], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(weights[p].double().numpy(), (ref_w / ref_w.max())[match], rtol=1e-4, atol=1e-7)
    assert (weights.amax(-1) == 1).all()
    _, ones = layout_problems(x, f, lay, t, K, sharing, fisher_weighted=False)
    assert (ones == 1).all()


def test_sink_tokens_are_excluded(tiny_capture, tmp_path):
    """Huge sink keys change nothing: the fit (and every centroid) ignores them."""
    reader, kv = tiny_capture
    for path in reader.files + [reader.dir / "meta.json"]:
        (tmp_path / path.name).write_bytes(path.read_bytes())
    for path in sorted(tmp_path.glob("seq*.safetensors")):
        tensors = load_file(str(path))
        for name in tensors:
            if name.startswith("key.") or name.startswith("fisher_key."):
                tensors[name][:SINKS] = 1e4
        save_file(tensors, str(path))
    outliers = CaptureReader(tmp_path)
    assert outliers.load("key", (0,), include_sinks=True).abs().max() == 1e4
    quant = quant_config()
    layouts = [lay for lay in plan_layouts(kv, quant) if lay.kind == "key"]
    clean, _ = fit_codebooks(reader, layouts, {}, quant, FAST, kv, CPU)
    dirty, _ = fit_codebooks(outliers, layouts, {}, quant, FAST, kv, CPU)
    for lay in layouts:
        assert torch.equal(clean.codecs[lay.key].codebook, dirty.codecs[lay.key].codebook)
        assert dirty.codecs[lay.key].codebook.abs().max() < 1e2


def test_fit_is_deterministic_and_order_independent(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config()
    layouts = plan_layouts(kv, quant)
    a, _ = fit_codebooks(reader, layouts, {}, quant, FAST, kv, CPU)
    b, _ = fit_codebooks(reader, layouts[::-1][:2], {}, quant, FAST, kv, CPU)
    for key in b.codecs:
        assert torch.equal(a.codecs[key].codebook, b.codecs[key].codebook)
    other_seed = KMeansConfig(iterations=25, backend="torch", seed=1)
    c, _ = fit_codebooks(reader, layouts[:1], {}, quant, other_seed, kv, CPU)
    assert not torch.equal(c.codecs[layouts[0].key].codebook, a.codecs[layouts[0].key].codebook)


@needs_faiss
def test_fit_codebooks_faiss_equals_torch(tiny_capture):
    """Same seed, so the same k-means++ init; a fixed number of updates: the backends agree."""
    reader, kv = tiny_capture
    quant = quant_config(sharing="groups")  # 4 codebooks per layout: faiss pays a fixed cost per problem
    layouts = plan_layouts(kv, quant)[:2]
    fits = {b: fit_codebooks(reader, layouts, {}, quant, KMeansConfig(iterations=6, tolerance=0.0, backend=b), kv, CPU)
            for b in ("torch", "faiss")}
    for lay in layouts:
        reports = [fits[b][1]["layouts"][lay.key] for b in fits]
        assert [r["backend"] for r in reports] == ["torch", "faiss"] and reports[0]["empty_clusters"] == 0
        assert reports[0]["objective_init"] == reports[1]["objective_init"]
        torch.testing.assert_close(fits["torch"][0].codecs[lay.key].codebook, fits["faiss"][0].codecs[lay.key].codebook,
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_fit_codebooks_on_cuda_matches_cpu(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config(method="tasq+loopvq")
    layouts = plan_layouts(kv, quant)[:2]
    transforms = tasq_transforms(layouts, kv)
    on_cpu, _ = fit_codebooks(reader, layouts, transforms, quant, FAST, kv, CPU)
    on_gpu, report = fit_codebooks(reader, layouts, transforms, quant, KMeansConfig(iterations=25), kv, torch.device("cuda"))
    assert report["totals"]["backend"] == "triton" and report["totals"]["device"] == "cuda"  # auto on CUDA
    for lay in layouts:
        torch.testing.assert_close(on_gpu.codecs[lay.key].codebook, on_cpu.codecs[lay.key].codebook, atol=1e-4, rtol=1e-4)


def test_too_few_tokens_for_the_codebook(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config(codebook_size=256)  # 112 tokens < 256 codewords per (head, group)
    with pytest.raises(ValueError, match=r"quant.codebook_size 256.*112 .*data.num_sequences 4"):
        fit_codebooks(reader, plan_layouts(kv, quant), {}, quant, FAST, kv, CPU)
