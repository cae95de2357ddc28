"""The capture's in-memory stores (calibration/capture/kv.py: MemoryCapture, MemoryReader): memory, device and
split read like the disk capture; the device store makes no host copies; on a GPU the memory store copies into
pinned host slabs (one per tensor under several processes); release lets go of them."""

from __future__ import annotations

import pytest
import torch
from conftest import calib_set, make_tiny_ouro
from safetensors.torch import load_file
from support.capture import run_capture

from loopvq_calib.calibration.capture.kv import MemoryCapture, capture_kv, capture_sequence, write_meta
from loopvq_calib.calibration.capture.reader import MemoryReader
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.runtime.processes import DistContext


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
    # also the kernels' first launch (CUDA loads them lazily)
    waited = reader.load("fisher_value", (2, 3), device="cuda")
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
