"""The k-means stage on a real tiny capture: layout problems and their Fisher weights, codebook fitting
for every sharing, TaSQ, sinks, determinism (the stage across backends: test_kmeans_backends.py; the backends
themselves: test_kmeans_solvers.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.builders import CPU, np_assign
from support.kmeans import (
    FAST,
    SINKS,
    G,
    K,
    quant_config,
    tasq_transforms,
    tiny_capture,  # noqa: F401 (the fixture)
)

from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.kmeans.fit import fit_codebooks, layout_problems, run_points_per_codebook
from loopvq_calib.codes.codec import gather_groups
from loopvq_calib.codes.layouts import plan_layouts, points_per_codebook
from loopvq_calib.config.schema import KMeansConfig


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


def test_too_few_tokens_for_the_codebook(tiny_capture):
    reader, kv = tiny_capture
    quant = quant_config(codebook_size=256)  # 112 tokens < 256 codewords per (head, group)
    with pytest.raises(ValueError, match=r"quant.codebook_size 256.*112 .*data.num_sequences 4"):
        fit_codebooks(reader, plan_layouts(kv, quant), {}, quant=quant, cfg=FAST, kv=kv, device=CPU)
