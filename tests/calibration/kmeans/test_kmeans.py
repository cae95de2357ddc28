"""The k-means stage on a real tiny capture: layout problems and their Fisher weights, codebook fitting
for every sharing, TaSQ, sinks, determinism, backends agreeing (the backends themselves:
test_kmeans_solvers.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import make_tiny_ouro
from safetensors.torch import load_file, save_file
from support.builders import np_assign

from loopvq_calib.calibration.capture.kv import MemoryCapture, capture_kv, write_meta
from loopvq_calib.calibration.capture.reader import CaptureReader, MemoryReader
from loopvq_calib.calibration.kmeans import fit as kmeans, seeding, solvers
from loopvq_calib.calibration.kmeans.fit import fit_codebooks, layout_problems, layout_seed, run_points_per_codebook
from loopvq_calib.codes.codec import TasqTransform, gather_groups
from loopvq_calib.codes.layouts import plan_layouts, points_per_codebook
from loopvq_calib.config.schema import CaptureConfig, Config, KMeansConfig, QuantConfig
from loopvq_calib.config.validate import validate
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.kernels import backends as kernel_backends, kmeans as kmeans_triton

CPU = torch.device("cpu")
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: Triton's interpreter
K, G = 16, 8
SINKS = 4
needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None, reason="faiss is not installed")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
    capture_kv(model, calib, kv, cfg=cap, out=out)
    write_meta(out, calib, kv, cfg=cap)
    return CaptureReader(out), kv


def quant_config(method: str = "loopvq", sharing: str = "none", codebook_size: int = K) -> QuantConfig:
    cfg = Config()
    cfg.quant = QuantConfig(
        method=method, bits=None, codebook_size=codebook_size, group_size=G, codebook_sharing=sharing
    )
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
    q, report = fit_codebooks(reader, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU, progress=calls.append)
    assert calls == [1] * len(layouts) and set(q.codecs) == {lay.key for lay in layouts}
    hc = 1 if sharing in ("heads", "all") else kv.kv_heads
    nc = 1 if sharing in ("groups", "all") else layouts[0].num_groups
    for lay in layouts:
        codec = q.codecs[lay.key]
        assert tuple(codec.codebook.shape) == (hc, nc, K, G) and codec.codebook.dtype == torch.float32
        r = report["layouts"][lay.key]
        assert len(r["objective_init"]) == hc * nc and r["backend"] == "torch"
        # the points each codebook was fitted on: what the run's helper (the backend probe's size) says
        m = reader.meta
        assert r["points_per_codebook"] == run_points_per_codebook(
            layouts, m["num_sequences"], m["sequence_length"], sink_tokens=m["sink_tokens"], sharing=sharing
        )
        assert r["points_per_codebook"] == reader.load(lay.kind, lay.sites).shape[0] * kv.kv_heads * lay.num_groups // (
            hc * nc
        )
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
    q, _ = fit_codebooks(reader, layouts, transforms, quant=quant, cfg=FAST, kv=kv, device=CPU)
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
    q_cq, _ = fit_codebooks(reader, cq_layouts, {}, quant=cq, cfg=FAST, kv=kv, device=CPU)
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
    points, weights = layout_problems(x, f, lay, transform=t, codebook_size=K, sharing=sharing)
    xn, fn, wn = x.double().numpy(), f.double().numpy(), t.weight.double().numpy()
    sigma = t.sigma(x).double().numpy()  # [N, T]
    y = xn * wn / sigma[..., None, None]
    factor = fn * (sigma[..., None, None] / wn) ** 2
    n, steps, h, d = xn.shape
    flat_y = y.transpose(0, 2, 1, 3).reshape(n, h, steps * d)
    flat_f = factor.transpose(0, 2, 1, 3).reshape(n, h, steps * d)
    groups = lay.groups[0].numpy()
    pts = {
        (hh, g): (flat_y[:, hh, groups[g]], flat_f[:, hh, groups[g]].sum(-1))
        for hh in range(h)
        for g in range(len(groups))
    }
    if sharing == "none":
        problems = [[(hh, g)] for hh in range(h) for g in range(len(groups))]
    elif sharing == "heads":
        problems = [[(hh, g) for hh in range(h)] for g in range(len(groups))]
    else:
        problems = [[(hh, g) for g in range(len(groups))] for hh in range(h)]
    assert points.shape == (len(problems), n * len(problems[0]), G)
    assert points_per_codebook(lay, n, sharing) == points.shape[1]
    for p, members in enumerate(problems):  # the order of points inside a problem is free: match them
        ref_x = np.concatenate([pts[m][0] for m in members])
        ref_w = np.concatenate([pts[m][1] for m in members])
        got_x = points[p].double().numpy()
        match = np_assign(got_x, ref_x)
        assert sorted(match.tolist()) == list(range(len(ref_x)))
        np.testing.assert_allclose(got_x, ref_x[match], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(weights[p].double().numpy(), (ref_w / ref_w.max())[match], rtol=1e-4, atol=1e-7)
    assert (weights.amax(-1) == 1).all()
    _, ones = layout_problems(x, f, lay, transform=t, codebook_size=K, sharing=sharing, fisher_weighted=False)
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
    clean, _ = fit_codebooks(reader, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    dirty, _ = fit_codebooks(outliers, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    for lay in layouts:
        assert torch.equal(clean.codecs[lay.key].codebook, dirty.codecs[lay.key].codebook)
        assert dirty.codecs[lay.key].codebook.abs().max() < 1e2


def test_fit_is_deterministic_and_order_independent(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config()
    layouts = plan_layouts(kv, quant)
    a, _ = fit_codebooks(reader, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    b, _ = fit_codebooks(reader, layouts[::-1][:2], {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    for key in b.codecs:
        assert torch.equal(a.codecs[key].codebook, b.codecs[key].codebook)
    other_seed = KMeansConfig(iterations=25, backend="torch", seed=1)
    c, _ = fit_codebooks(reader, layouts[:1], {}, quant=quant, cfg=other_seed, kv=kv, device=CPU)
    assert not torch.equal(c.codecs[layouts[0].key].codebook, a.codecs[layouts[0].key].codebook)


@pytest.mark.skipif(
    not kernel_backends.available(kernel_backends.Backend.TRITON, TRITON_DEVICE),
    reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1",
)
def test_fused_path_solves_layouts_together_as_one_at_a_time(tiny_capture, monkeypatch):
    """On the fused Triton path consecutive layouts share one Lloyd loop (here all 4 in one weighted_kmeans
    call); each layout gets the codebooks, objectives and Lloyd updates it gets when solved alone."""
    reader, kv = tiny_capture
    quant = quant_config(method="tasq+loopvq")
    layouts = plan_layouts(kv, quant)[:4]
    transforms = tasq_transforms(layouts, kv)
    cfg = KMeansConfig(iterations=8, backend="triton")
    real, calls = kmeans.weighted_kmeans, []

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(kmeans, "weighted_kmeans", counted)
    together, joined = fit_codebooks(reader, layouts, transforms, quant=quant, cfg=cfg, kv=kv, device=TRITON_DEVICE)
    problems = kv.kv_heads * layouts[0].num_groups
    assert calls == [4 * problems]
    calls.clear()
    monkeypatch.setattr(kmeans, "LLOYD_GROUP_BYTES", 0)  # no room to join: one layout per loop
    alone, single = fit_codebooks(reader, layouts, transforms, quant=quant, cfg=cfg, kv=kv, device=TRITON_DEVICE)
    assert calls == [problems] * 4
    assert list(together.codecs) == list(alone.codecs) == [lay.key for lay in layouts]
    for lay in layouts:
        a, b = joined["layouts"][lay.key], single["layouts"][lay.key]
        assert a["iterations"] == b["iterations"] and a["objective_init"] == pytest.approx(
            b["objective_init"], rel=1e-6
        )
        assert a["objective_final"] == pytest.approx(b["objective_final"], rel=1e-5)
        torch.testing.assert_close(together.codecs[lay.key].codebook, alone.codecs[lay.key].codebook)


def test_fused_schedule_seeds_the_next_group_before_a_lloyd_loop_and_keeps_the_results(tiny_capture, monkeypatch):
    """The fused path's schedule, on the CPU with the fused kernels replaced by the torch code of the same rules:
    layouts are grouped (here two per Lloyd loop), a group's loop starts only once the group after it is loaded
    and seeded (that seeding runs on a second stream during the loop on CUDA), and the codebooks are those of the
    torch backend solving one layout at a time."""
    reader, kv = tiny_capture
    quant = quant_config(method="cq")  # one loop step per layout: 16 layouts
    layouts = plan_layouts(kv, quant)[:6]
    cfg = KMeansConfig(iterations=12)
    reference, ref_report = fit_codebooks(
        reader, layouts, {}, quant=quant, cfg=KMeansConfig(iterations=12, backend="torch"), kv=kv, device=CPU
    )

    events = []
    real_problems, real_solve = kmeans.layout_problems, kmeans.weighted_kmeans

    def problems(x, fisher, layout, *args, **kwargs):
        events.append(("seed", layout.key))
        return real_problems(x, fisher, layout, *args, **kwargs)

    def solve(x, *args, **kwargs):
        events.append(("lloyd", x.shape[0]))
        return real_solve(x, *args, **kwargs)

    def lloyd_step(x, w, c, rows, accumulate):
        return solvers._assign(x[rows], x[rows].pow(2).sum(-1), w[rows], c=c, chunk=1 << 20, accumulate=accumulate)

    for module in (kmeans, solvers):
        monkeypatch.setattr(module, "resolve_backend", lambda *a, **k: "triton")
    monkeypatch.setattr(kmeans, "layout_problems", problems)
    monkeypatch.setattr(kmeans, "weighted_kmeans", solve)
    monkeypatch.setattr(kmeans_triton, "lloyd_step", lloyd_step)
    monkeypatch.setattr(kmeans_triton, "kmeans_pp", seeding._kmeans_pp_rows)
    problems_per_layout = kv.kv_heads * layouts[0].num_groups
    points = real_problems(
        reader.load(layouts[0].kind, layouts[0].sites),
        reader.load("fisher_" + layouts[0].kind, layouts[0].sites),
        layouts[0],
        transform=None,
        codebook_size=K,
        sharing="none",
    )[0]
    monkeypatch.setattr(kmeans, "LLOYD_GROUP_BYTES", 2 * points.numel() * 4)  # two layouts per Lloyd loop
    fused, report = fit_codebooks(reader, layouts, {}, quant=quant, cfg=cfg, kv=kv, device=CPU)

    seeded = [("seed", lay.key) for lay in layouts]
    group = ("lloyd", 2 * problems_per_layout)
    assert events == seeded[:5] + [group] + seeded[5:] + [group, group]
    assert list(fused.codecs) == [lay.key for lay in layouts] and report["totals"]["backend"] == "triton"
    for lay in layouts:
        assert report["layouts"][lay.key]["iterations"] == ref_report["layouts"][lay.key]["iterations"]
        torch.testing.assert_close(fused.codecs[lay.key].codebook, reference.codecs[lay.key].codebook)


def test_faiss_layouts_are_seeded_by_their_own_layout_seed(tiny_capture, monkeypatch):
    """faiss solves one layout per call and draws from that layout's seed (kmeans.layout_seed), not kmeans.seed."""
    reader, kv = tiny_capture
    quant = quant_config()
    layouts = plan_layouts(kv, quant)[:2]
    seeds = []
    monkeypatch.setattr(kmeans, "resolve_backend", lambda *a, **k: "faiss")
    monkeypatch.setattr(solvers, "resolve_backend", lambda *a, **k: "faiss")
    monkeypatch.setattr(
        solvers,
        "_faiss_kmeans",
        lambda x, w, init, cfg, seed, device: (
            seeds.append(seed)
            or solvers.KMeansResult(
                init.clone(),
                torch.zeros(x.shape[0]),
                torch.zeros(x.shape[0]),
                torch.zeros(x.shape[0], dtype=torch.long),
                torch.zeros(x.shape[0], dtype=torch.long),
            )
        ),
    )
    fit_codebooks(reader, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    assert seeds == [layout_seed(FAST.seed, lay) for lay in layouts] and len(set(seeds)) == 2


@needs_faiss
def test_fit_codebooks_faiss_equals_torch(tiny_capture):
    """Same seed, so the same k-means++ init; a fixed number of updates: the backends agree."""
    reader, kv = tiny_capture
    quant = quant_config(sharing="groups")  # 4 codebooks per layout: faiss pays a fixed cost per problem
    layouts = plan_layouts(kv, quant)[:2]
    fits = {
        b: fit_codebooks(
            reader,
            layouts,
            {},
            quant=quant,
            cfg=KMeansConfig(iterations=6, tolerance=0.0, backend=b),
            kv=kv,
            device=CPU,
        )
        for b in ("torch", "faiss")
    }
    for lay in layouts:
        reports = [fits[b][1]["layouts"][lay.key] for b in fits]
        assert [r["backend"] for r in reports] == ["torch", "faiss"] and reports[0]["empty_clusters"] == 0
        assert reports[0]["objective_init"] == reports[1]["objective_init"]
        torch.testing.assert_close(
            fits["torch"][0].codecs[lay.key].codebook, fits["faiss"][0].codecs[lay.key].codebook, atol=1e-4, rtol=1e-4
        )


@pytest.mark.gpu
def test_fit_codebooks_on_cuda_matches_cpu(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config(method="tasq+loopvq")
    layouts = plan_layouts(kv, quant)[:2]
    transforms = tasq_transforms(layouts, kv)
    on_cpu, _ = fit_codebooks(reader, layouts, transforms, quant=quant, cfg=FAST, kv=kv, device=CPU)
    on_gpu, report = fit_codebooks(
        reader, layouts, transforms, quant=quant, cfg=KMeansConfig(iterations=25), kv=kv, device=torch.device("cuda")
    )
    assert report["totals"]["backend"] == "triton" and report["totals"]["device"] == "cuda"  # auto on CUDA
    for lay in layouts:
        torch.testing.assert_close(
            on_gpu.codecs[lay.key].codebook, on_cpu.codecs[lay.key].codebook, atol=1e-4, rtol=1e-4
        )


@pytest.mark.gpu
def test_fused_schedule_on_cuda_from_a_pinned_capture_matches_cpu(tmp_path, monkeypatch):
    """On CUDA with one layout per Lloyd loop (six loops: the seeding queued ahead on the side stream, the hand-offs
    between streams), the layouts read from an in-memory capture in pinned host memory: the CPU backend's codebooks."""
    model = make_tiny_ouro().cuda()
    kv = model.kv_layout()
    calib = CalibrationSet(
        input_ids=torch.randint(0, 4096, (4, 32), generator=gen(0)), train=[0, 1, 2], heldout=[3], sink_tokens=SINKS
    )
    mem, cap = MemoryCapture(), CaptureConfig(dtype="float32", store="memory")
    capture_kv(model, calib, kv, cfg=cap, out=mem)
    write_meta(tmp_path, calib, kv, cfg=cap, memory=mem)
    reader = MemoryReader(mem)
    assert mem.sequences[0]["key.0"].is_pinned()
    quant = quant_config(method="cq")
    layouts = plan_layouts(kv, quant)[:6]
    on_cpu, _ = fit_codebooks(reader, layouts, {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
    monkeypatch.setattr(kmeans, "LLOYD_GROUP_BYTES", 1)  # no two layouts share a loop
    on_gpu, report = fit_codebooks(
        reader, layouts, {}, quant=quant, cfg=KMeansConfig(iterations=25), kv=kv, device=torch.device("cuda")
    )
    assert report["totals"]["backend"] == "triton" and list(on_gpu.codecs) == [lay.key for lay in layouts]
    for lay in layouts:
        torch.testing.assert_close(
            on_gpu.codecs[lay.key].codebook, on_cpu.codecs[lay.key].codebook, atol=1e-4, rtol=1e-4
        )


def test_too_few_tokens_for_the_codebook(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config(codebook_size=256)  # 112 tokens < 256 codewords per (head, group)
    with pytest.raises(ValueError, match=r"quant.codebook_size 256.*112 .*data.num_sequences 4"):
        fit_codebooks(reader, plan_layouts(kv, quant), {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
