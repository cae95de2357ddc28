"""Capture stage: stored keys/values/Fisher against direct computations, batching, determinism, reruns,
processes, errors, Fisher over channel chunks and TaSQ keys' Fisher. The in-memory stores are checked in
test_capture_memory.py, the sequences shared between processes in test_capture_share.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import calib_set, make_tiny_huginn, make_tiny_ouro
from safetensors import safe_open
from support.capture import run_capture

from loopvq_calib.calibration.capture import kv as capture_module
from loopvq_calib.calibration.capture.kv import CaptureError, capture_kv, shard_path, write_meta
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.calibration.kmeans.fit import layout_problems
from loopvq_calib.calibration.tasq.grouping import rope_pair_units
from loopvq_calib.calibration.tasq.stats import channel_weights
from loopvq_calib.codes.codec import TasqTransform
from loopvq_calib.codes.layouts import BlockLayout
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.runtime.files import TMP_PREFIX
from loopvq_calib.runtime.processes import DistContext


def direct_fisher(model, ids: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
    """d(summed next-token loss)/d(pre-RoPE key, value) at one site, by making them autograd leaves."""
    leaves = {}

    def hook(s, k, v, pos):
        if s != site:
            return k, v
        leaves["k"], leaves["v"] = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        return leaves["k"], leaves["v"]

    model.kv_hook = hook
    try:
        logits = model(ids).logits
    finally:
        model.kv_hook = None
    loss = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum")
    gk, gv = torch.autograd.grad(loss, [leaves["k"], leaves["v"]])
    return gk[0].pow(2), gv[0].pow(2)


@pytest.mark.parametrize("make", [make_tiny_ouro, make_tiny_huginn])
def test_stored_tensors_equal_direct_computations(tmp_path, make):
    model = make()
    calib = calib_set()
    reader = run_capture(model, calib, tmp_path, dtype="float32")
    ids = calib.input_ids[1:2]
    projections = []
    layer = model.model.layers[0] if hasattr(model, "model") else model.transformer.core_block[0]
    handle = (
        layer.self_attn.k_proj.register_forward_hook(lambda m, i, o: projections.append(o))
        if hasattr(layer, "self_attn")
        else None
    )
    model(ids)
    if handle:
        handle.remove()
    kv = model.kv_layout()
    with safe_open(str(tmp_path / "seq00001.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("input_ids"), ids[0])
        if handle:  # Ouro: key = k_proj output before RoPE; layer 0 is site step * layers
            for step, proj in enumerate(projections):
                torch.testing.assert_close(f.get_tensor(f"key.{step * 2}"), proj[0].view(24, 4, 16))
        for site in (kv.sites[0].site, kv.sites[-1].site):
            fk, fv = direct_fisher(model, ids, site)
            torch.testing.assert_close(f.get_tensor(f"fisher_key.{site}"), fk, rtol=1e-4, atol=1e-10)
            torch.testing.assert_close(f.get_tensor(f"fisher_value.{site}"), fv, rtol=1e-4, atol=1e-10)
    x = reader.load("key", (kv.sites[0].site,))
    assert x.shape == (3 * (24 - 4), 1, 4, 16)  # sinks excluded
    full = reader.load("key", (kv.sites[0].site,), include_sinks=True)
    torch.testing.assert_close(full.view(3, 24, 1, 4, 16)[:, 4:].reshape(-1, 1, 4, 16), x)


def test_batched_capture_equals_one_sequence_at_a_time(tmp_path):
    model = make_tiny_ouro()
    calib = calib_set(n=4)
    a = run_capture(model, calib, tmp_path / "a", dtype="float32", batch_size=1)
    b = run_capture(model, calib, tmp_path / "b", dtype="float32", batch_size=2)
    for name in ("key", "value", "fisher_key", "fisher_value"):
        torch.testing.assert_close(a.load(name, (0, 3, 7)), b.load(name, (0, 3, 7)), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(a.query_stats(5), b.query_stats(5), rtol=1e-5, atol=1e-7)


def test_without_query_stats_the_capture_is_the_same_less_its_query_statistics(tmp_path):
    """``query_stats=False`` (methods without TaSQ) stores no ``qstat.*`` and the same keys, values and Fisher."""
    model, calib = make_tiny_ouro(), calib_set(n=2)
    full = run_capture(model, calib, tmp_path / "full", dtype="float32")
    config = CaptureConfig(dtype="float32")
    capture_kv(model, calib, model.kv_layout(), cfg=config, out=tmp_path / "lean", query_stats=False)
    write_meta(tmp_path / "lean", calib, model.kv_layout(), cfg=config)
    lean = CaptureReader(tmp_path / "lean")
    for a, b in zip(full.files, lean.files):
        with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
            assert set(fb.keys()) == {k for k in fa.keys() if not k.startswith("qstat.")} != set(fa.keys())
            for k in fb.keys():
                assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), k


def test_two_runs_give_byte_identical_files(tmp_path):
    model = make_tiny_ouro()
    calib = calib_set()
    run_capture(model, calib, tmp_path / "a")
    run_capture(model, calib, tmp_path / "b")
    for path in sorted((tmp_path / "a").iterdir()):
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_a_rerun_keeps_whole_shards_and_removes_a_killed_runs_partial_one(tmp_path, monkeypatch):
    """Sequences whose shard is whole are not captured again (they count as progress); a killed run's temporary
    shard is removed; the files equal an uninterrupted capture's."""
    model, calib = make_tiny_ouro(), calib_set()
    clean = run_capture(model, calib, tmp_path / "clean")
    run = tmp_path / "run"
    run.mkdir()
    shard_path(run, 0).write_bytes(shard_path(clean.dir, 0).read_bytes())
    (run / f"{TMP_PREFIX}seq00001.safetensors.99999").write_bytes(b"half a shard")
    real, forwards, done = capture_module.capture_sequence, [], []
    monkeypatch.setattr(
        capture_module,
        "capture_sequence",
        lambda *a, seqs, **k: forwards.append(list(seqs)) or real(*a, seqs=seqs, **k),
    )
    captured = capture_kv(model, calib, model.kv_layout(), cfg=CaptureConfig(), out=run, progress=done.append)
    assert captured == [0, 1, 2] and forwards == [[1], [2]] and done == [1, 1, 1]
    assert sorted(p.name for p in run.iterdir()) == [shard_path(run, i).name for i in range(3)]
    for i in range(3):
        assert shard_path(run, i).read_bytes() == shard_path(clean.dir, i).read_bytes()


def test_storage_dtype(tmp_path):
    model = make_tiny_ouro()
    reader = run_capture(model, calib_set(), tmp_path, dtype="bfloat16")
    with safe_open(str(reader.files[0]), "pt") as f:
        assert f.get_tensor("key.0").dtype == torch.bfloat16 and f.get_tensor("qstat.0").dtype == torch.float32
    assert reader.load("value", (1,)).dtype == torch.float32


def test_non_finite_values_stop_the_run_naming_site_and_sequence(tmp_path):
    model = make_tiny_ouro()
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("inf")
    with pytest.raises(
        CaptureError, match=r"non-finite values in \w+ at site 1 \(loop step 0, layer 1, loop\), calibration sequence 0"
    ):
        run_capture(model, calib_set(), tmp_path)
    assert not list(tmp_path.glob("seq*.safetensors"))


def test_processes_split_sequences(tmp_path):
    """Each process captures its sequences and removes a killed run's partial shards of those only (another
    process may be writing its own at that moment)."""
    model = make_tiny_ouro()
    calib = calib_set(n=5)
    kv, cfg = model.kv_layout(), CaptureConfig()
    own, others = tmp_path / f"{TMP_PREFIX}seq00002.safetensors.99999", tmp_path / f"{TMP_PREFIX}seq00001.safetensors.7"
    for partial in (own, others):
        partial.write_bytes(b"half a shard")
    assert capture_kv(model, calib, kv, cfg=cfg, out=tmp_path, dist=DistContext(0, 2)) == [0, 2, 4]
    assert not own.exists() and others.read_bytes() == b"half a shard"
    with pytest.raises(CaptureError, match=r"sequences \[1, 3\] have no file"):
        write_meta(tmp_path, calib, kv, cfg=cfg)
    assert capture_kv(model, calib, kv, cfg=cfg, out=tmp_path, dist=DistContext(1, 2)) == [1, 3]
    write_meta(tmp_path, calib, kv, cfg=cfg)


def test_fisher_summed_over_channel_chunks_keeps_group_weights(tmp_path):
    model = make_tiny_ouro()
    calib = calib_set()
    full = run_capture(model, calib, tmp_path / "full", dtype="float32")
    chunked = run_capture(model, calib, tmp_path / "chunk", dtype="float32", fisher_channels=4)
    with safe_open(str(chunked.files[0]), "pt") as f:
        assert tuple(f.get_tensor("fisher_key.0").shape) == (24, 4, 4)  # [S, H, D/4]
    a, b = full.load("fisher_key", (0, 2)), chunked.load("fisher_key", (0, 2))
    assert a.shape == b.shape
    # any group made of whole 4-channel chunks gets the same summed weight
    torch.testing.assert_close(a.unflatten(-1, (4, 4)).sum(-1), b.unflatten(-1, (4, 4)).sum(-1), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("make", [make_tiny_ouro, make_tiny_huginn])  # half | interleaved RoPE
def test_tasq_key_fisher_keeps_every_group_weight(tmp_path, make):
    """A TaSQ capture stores the keys' Fisher as F / w^2 per RoPE pair; k-means' weight of any group made of
    whole RoPE pairs (sigma^2 * sum F_i / w_i^2) equals the one from the per-coordinate Fisher."""
    model, calib = make(), calib_set(n=3, length=32)
    kv = model.kv_layout()
    full = run_capture(model, calib, tmp_path / "full", dtype="float32")
    cfg = CaptureConfig(dtype="float32")
    capture_kv(model, calib, kv, cfg=cfg, out=tmp_path / "tasq", tasq_floor=1e-6)
    write_meta(tmp_path / "tasq", calib, kv, cfg=cfg, tasq_keys=True)
    reduced = CaptureReader(tmp_path / "tasq")
    assert reduced.tasq_keys and not full.tasq_keys
    with safe_open(str(tmp_path / "tasq" / "seq00000.safetensors"), "pt") as f:
        assert f.get_slice("fisher_key.0").get_shape() == [32, kv.kv_heads, kv.head_dim // 2]
        assert f.get_slice("fisher_value.0").get_shape() == [32, kv.kv_heads, kv.head_dim]
    sites = tuple(s.site for s in kv.sites if s.looped)[:2]
    for s in sites:  # the forward-only pass gives the statistics the capture's forward gave
        torch.testing.assert_close(reduced.query_stats(s), full.query_stats(s), rtol=1e-6, atol=0)
    weight = torch.stack([channel_weights(reduced.query_stats(s), 1e-6) for s in sites])
    transform = TasqTransform(weight)
    units = rope_pair_units(kv.head_dim, len(sites), kv.rope_style)
    gen = torch.Generator().manual_seed(0)
    groups = torch.stack([units[torch.randperm(len(units), generator=gen)].view(-1, 4) for _ in range(kv.kv_heads)])
    layout = BlockLayout("b", "key", sites, kv.head_dim, kv.kv_heads, groups)
    layout.check()
    x = full.load("key", sites)
    assert torch.equal(x, reduced.load("key", sites))
    _, want = layout_problems(
        x, full.load("fisher_key", sites), layout, transform=transform, codebook_size=4, sharing="none"
    )
    _, got = layout_problems(
        x,
        reduced.load("fisher_key", sites),
        layout,
        transform=transform,
        codebook_size=4,
        sharing="none",
        fisher_tasq_weighted=True,
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="TaSQ-weighted key Fisher"):
        layout_problems(
            x,
            reduced.load("fisher_key", sites),
            layout,
            transform=None,
            codebook_size=4,
            sharing="none",
            fisher_tasq_weighted=True,
        )
