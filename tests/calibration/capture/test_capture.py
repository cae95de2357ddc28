"""Capture stage: stored keys/values/Fisher against direct computations, batching, determinism, errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import calib_set, make_tiny_huginn, make_tiny_ouro
from safetensors import safe_open
from safetensors.torch import load_file

from loopvq_calib.calibration.capture import kv as capture_module
from loopvq_calib.calibration.capture.kv import (
    CaptureError,
    MemoryCapture,
    capture_kv,
    capture_sequence,
    shard_path,
    share_sequences,
    write_meta,
)
from loopvq_calib.calibration.capture.reader import CaptureReader, MemoryReader
from loopvq_calib.calibration.kmeans.fit import layout_problems
from loopvq_calib.calibration.tasq.grouping import rope_pair_units
from loopvq_calib.calibration.tasq.stats import channel_weights
from loopvq_calib.codes.codec import TasqTransform
from loopvq_calib.codes.layouts import BlockLayout
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.runtime import host_memory as hm
from loopvq_calib.runtime.files import TMP_PREFIX
from loopvq_calib.runtime.processes import DistContext


def run_capture(model, calib, folder, **cfg) -> CaptureReader:
    config = CaptureConfig(**cfg)
    capture_kv(model, calib, model.kv_layout(), cfg=config, out=folder)
    write_meta(folder, calib, model.kv_layout(), cfg=config)
    return CaptureReader(folder)


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


def _store_reads_like_disk(tmp_path, model, store):
    calib = calib_set()
    disk = run_capture(model, calib, tmp_path, dtype="float32")
    mem = MemoryCapture()
    cfg = CaptureConfig(dtype="float32", store=store)
    capture_kv(model, calib, model.kv_layout(), cfg=cfg, out=mem)
    (tmp_path / "m").mkdir()
    assert write_meta(tmp_path / "m", calib, model.kv_layout(), cfg=cfg, memory=mem)["store"] == store
    reader = MemoryReader(mem)
    for name in ("key", "fisher_value"):
        a, b = reader.load(name, (2, 4)), disk.load(name, (2, 4))
        if a.is_cuda:  # two GPU forwards may differ in float order
            torch.testing.assert_close(a.cpu(), b.cpu(), atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(a, b)
    torch.testing.assert_close(reader.query_stats(3), disk.query_stats(3))
    assert torch.equal(reader.input_ids(), calib.input_ids)
    return mem


def test_memory_store_reads_like_disk(tmp_path):
    """(The device store on a CPU is the memory store: it is tested by the no-host-copies spy below and, on a
    GPU, by test_device_store_keeps_the_capture_on_the_gpu.)"""
    mem = _store_reads_like_disk(tmp_path, make_tiny_ouro(), "memory")
    assert all(t.device.type == "cpu" for seq in mem.sequences.values() for t in seq.values())


def test_device_store_makes_no_host_copies(monkeypatch):
    """capture_sequence(on_device=True) never calls .cpu() on the stored tensors: per sequence, exactly
    (4 per site + input_ids) fewer .cpu() calls than the host store (query statistics go to the host in both)."""
    model = make_tiny_ouro()
    kv = model.kv_layout()
    ids = calib_set().input_ids[:2]
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    counts = []
    for on_device in (False, True):
        calls.clear()
        capture_sequence(model, ids, kv, seqs=[0, 1], fisher_channels=1, on_device=on_device)
        counts.append(len(calls))
    assert counts[0] - counts[1] == 2 * (4 * kv.num_sites + 1)


@pytest.mark.gpu
def test_device_store_keeps_the_capture_on_the_gpu(tmp_path):
    mem = _store_reads_like_disk(tmp_path, make_tiny_ouro().cuda(), "device")
    seq = mem.sequences[0]
    assert seq["key.0"].is_cuda and seq["fisher_value.3"].is_cuda and not seq["qstat.0"].is_cuda


@pytest.mark.gpu
def test_memory_store_on_a_gpu_copies_into_pinned_host_memory(tmp_path):
    """The host copies run on the copier's worker (same values as the disk capture of the same forwards, within
    GPU float order) into one pinned slab per sequence, unpinned by release()."""
    mem = _store_reads_like_disk(tmp_path, make_tiny_ouro().cuda(), "memory")
    seq = mem.sequences[1]
    assert not seq["key.0"].is_cuda and seq["key.0"].is_pinned() and seq["fisher_value.3"].is_pinned()
    disk = load_file(str(tmp_path / "seq00001.safetensors"))
    assert seq.keys() == disk.keys()
    for name, t in disk.items():  # the slab holds what the disk capture of the same forwards stored
        assert seq[name].dtype == t.dtype and seq[name].shape == t.shape, name
        torch.testing.assert_close(seq[name], t, atol=1e-5, rtol=1e-4)
    assert torch.equal(seq["input_ids"], calib_set().input_ids[1]) and len(mem.copier.pinned) == 3

    reader = MemoryReader(mem)
    waited = reader.load(
        "fisher_value", (2, 3), device="cuda"
    )  # also the kernels' first launch (CUDA loads them lazily)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # the pinned tensors' copies queue behind this without stopping the host
    queued = reader.load("fisher_value", (2, 3), device="cuda", non_blocking=True)
    assert not torch.cuda.current_stream().query()
    torch.testing.assert_close(queued, waited, rtol=0, atol=0)
    mem.copier.release()
    assert (
        not seq["key.0"].is_pinned()
        and not mem.copier.pinned
        and torch.equal(seq["input_ids"], calib_set().input_ids[1])
    )


@pytest.mark.gpu
def test_memory_store_under_several_processes_gives_each_tensor_its_own_pinned_slab():
    """Process 0 of 2 (its sequences 0 and 2): one slab per tensor, so share_sequences can free what it drops."""
    model, calib = make_tiny_ouro().cuda(), calib_set()
    mem = MemoryCapture()
    capture_kv(
        model,
        calib,
        model.kv_layout(),
        cfg=CaptureConfig(dtype="float32", store="memory"),
        out=mem,
        dist=DistContext(0, 2),
    )
    assert sorted(mem.sequences) == [0, 2] and mem.copier.slab_per_tensor
    moved = [t for stored in mem.sequences.values() for n, t in stored.items() if not n.startswith("qstat")]
    assert all(t.is_pinned() for t in moved)
    assert len({t.untyped_storage().data_ptr() for t in moved}) == len(moved) == len(mem.copier.pinned)
    mem.copier.release()


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


def _share_worker(rank: int, world: int, init_file: str, queue) -> None:
    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    unpinned = []
    pinner = hm.HostPinner(lambda ptr, nbytes: 0, unpinned.append)  # locking succeeds (a CPU has nothing to lock)
    names = ["key.0", "key.1", "fisher_key.0", "value.0"]
    needs = [["key.0", "fisher_key.0"], ["key.1", "value.0"]]
    memory = MemoryCapture()
    memory.copier = hm.HostCopier(torch.device("cpu"), slab_per_tensor=True, pinner=pinner)  # as under 2 processes
    with memory.copier:  # this process's captured sequences, every tensor of each, copied into pinned slabs
        captured = {
            seq: {n: torch.full((3, 2), 10.0 * seq + i) for i, n in enumerate(names)} for seq in range(rank, 5, world)
        }
        futures = {seq: memory.copier.submit(stored, seq) for seq, stored in captured.items()}
        memory.sequences.update({seq: f.result() for seq, f in futures.items()})
    dropped = {t.data_ptr() for stored in memory.sequences.values() for n, t in stored.items() if n not in needs[rank]}
    pinned_after, drop_unused = [], memory.copier.drop_unused

    def recording_drop_unused(seq, stored):  # the slabs still pinned after each call
        freed = drop_unused(seq, stored)
        pinned_after.append(len(memory.copier.pinned))
        return freed

    memory.copier.drop_unused = recording_drop_unused
    share_sequences(memory, needs, DistContext(rank, world), num_sequences=5)
    kept = {memory.sequences[seq][n].data_ptr() for seq in futures for n in needs[rank]}
    pinned = {slab.data_ptr() for slab in memory.copier.pinned}
    queue.put(
        (
            rank,
            (
                {seq: {n: t.tolist() for n, t in d.items()} for seq, d in memory.sequences.items()},
                pinned == kept and len(kept) == 2 * len(futures),
                set(unpinned) == dropped,
                len(unpinned),
                pinned_after,
            ),
        )
    )
    torch_dist.destroy_process_group()


def test_share_sequences_gives_each_process_its_tensors_of_every_sequence(tmp_path):
    """Two gloo processes, 5 sequences captured 3 + 2 (through the host copier, one pinned slab per tensor):
    afterwards each holds exactly the tensors it needs of all 5 sequences, with the capturing process's
    values, and the slabs of the tensors it dropped are unpinned and let go as each sequence is sent: only its
    kept ones stay pinned."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_share_worker, args=(r, 2, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    index = {"key.0": 0, "key.1": 1, "fisher_key.0": 2, "value.0": 3}
    for rank, needs in ((0, ["key.0", "fisher_key.0"]), (1, ["key.1", "value.0"])):
        values, only_kept_pinned, dropped_unpinned, unpinned, pinned_after = results[rank]
        assert sorted(values) == [0, 1, 2, 3, 4]
        for seq, stored in values.items():
            assert sorted(stored) == sorted(needs)
            for n, t in stored.items():
                assert torch.equal(torch.tensor(t), torch.full((3, 2), 10.0 * seq + index[n]))
        assert only_kept_pinned and dropped_unpinned and unpinned == 2 * (3 - rank)  # 2 dropped per own sequence
        own = 3 - rank  # each sequence's 2 unneeded slabs go as soon as it is sent (not all at the end)
        assert pinned_after == [4 * own - 2 * k for k in range(1, own + 1)]


def test_share_sequences_needs_a_sequence_per_process():
    with pytest.raises(
        CaptureError, match="process 1 captured no sequence: data.num_sequences 1 is below the 2 processes"
    ):
        share_sequences(MemoryCapture(), [[], []], DistContext(1, 2), num_sequences=1)


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


@pytest.mark.gpu
def test_split_store_keeps_the_first_sequences_on_the_gpu(tmp_path):
    model, calib = make_tiny_ouro().cuda(), calib_set()
    disk = run_capture(model, calib, tmp_path, dtype="float32")
    mem, cfg = MemoryCapture(), CaptureConfig(dtype="float32", store="split")
    capture_kv(model, calib, model.kv_layout(), cfg=cfg, out=mem, device_sequences=1)
    (tmp_path / "m").mkdir()
    assert write_meta(tmp_path / "m", calib, model.kv_layout(), cfg=cfg, memory=mem)["store"] == "split"
    assert {seq: mem.sequences[seq]["key.0"].device.type for seq in range(3)} == {0: "cuda", 1: "cpu", 2: "cpu"}
    torch.testing.assert_close(MemoryReader(mem).load("key", (0, 1)), disk.load("key", (0, 1)), atol=1e-5, rtol=1e-4)


def test_memory_capture_release_drops_accelerator_tensors_at_once():
    """``MemoryCapture.release`` empties the capture, deletes its tensors off the host (meta tensors stand in for
    the accelerator's) before it returns, and lets go of the host ones in a background thread."""
    capture = MemoryCapture()
    stored = {"key.0": torch.zeros(2), "value.0": torch.empty(2, device="meta")}
    capture.sequences = {0: stored}
    thread = capture.release()
    assert list(stored) == ["key.0"] and capture.sequences == {} and capture.copier is None
    thread.join()
