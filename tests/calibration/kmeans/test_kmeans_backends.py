"""The k-means stage across its backends, on a real tiny capture: the fused Triton path solves consecutive layouts
in one Lloyd loop and seeds the next group during it (its schedule checked on the CPU too), faiss seeds each layout
by its own seed and agrees with torch, CUDA agrees with the CPU (from a pinned in-memory capture too). The backends
themselves: test_kmeans_solvers.py."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as TRITON_DEVICE, make_tiny_ouro
from support.builders import CPU
from support.kmeans import (
    FAST,
    SINKS,
    K,
    gen,
    needs_faiss,
    quant_config,
    tasq_transforms,
    tiny_capture,  # noqa: F401 (the fixture)
)

from loopvq_calib.calibration.capture.kv import MemoryCapture, capture_kv, write_meta
from loopvq_calib.calibration.capture.reader import MemoryReader
from loopvq_calib.calibration.kmeans import fit as kmeans, seeding, solvers
from loopvq_calib.calibration.kmeans.fit import fit_codebooks, layout_seed
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.config.schema import CaptureConfig, KMeansConfig
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.kernels import backends as kernel_backends, kmeans as kmeans_triton


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
