"""The capture's store: its size and choice (disk, host memory, device, split), and the HostCopier (capture to
host memory behind the capture): slabs, depth, errors, pageable fallback, releasing the slabs of dropped
tensors. On a CPU the copier runs its worker with no stream and copies host tensors; the CUDA calls that pin
and unpin are replaced by recorders (a CPU has nothing to pin)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from conftest import calib_set, make_tiny_huginn, make_tiny_ouro

import loopvq_calib.calibration.capture.store as cs
import loopvq_calib.runtime.host_memory as hm
from loopvq_calib.calibration.capture.kv import MemoryCapture, capture_kv
from loopvq_calib.config.schema import CaptureConfig
from loopvq_calib.config.source import ConfigError

CPU = torch.device("cpu")


def sequence(seq: int) -> dict[str, torch.Tensor]:
    """A captured sequence's tensors: distinct values per sequence and tensor, sizes not multiples of 64 bytes."""
    return {"key.0": torch.arange(30, dtype=torch.float32).view(5, 6) + 100 * seq,
            "fisher_key.0": torch.arange(21, dtype=torch.bfloat16).view(7, 3) + seq,
            "input_ids": torch.arange(5) * (seq + 1)}


@pytest.fixture
def pinning(monkeypatch):
    """cudaHostRegister succeeds (returns 0); registered and unregistered addresses are recorded."""
    calls = {"register": [], "unregister": [], "cleared": []}
    monkeypatch.setattr(hm, "_register", lambda ptr, nbytes: calls["register"].append((ptr, nbytes)) or 0)
    monkeypatch.setattr(hm, "_unregister", calls["unregister"].append)
    monkeypatch.setattr(hm, "_clear_cuda_error", lambda: calls["cleared"].append(threading.current_thread().name))
    return calls


def copy_all(copier: hm.HostCopier, seqs: range) -> dict[int, dict[str, torch.Tensor]]:
    with copier:
        futures = {seq: copier.submit(sequence(seq), seq) for seq in seqs}
        return {seq: f.result() for seq, f in futures.items()}


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("per_tensor", [False, True])
def test_copies_hold_the_values_in_pinned_slabs(pinning, per_tensor):
    copier = hm.HostCopier(CPU, slab_per_tensor=per_tensor)
    copied = copy_all(copier, range(3))
    for seq, stored in copied.items():
        for name, t in sequence(seq).items():
            assert stored[name].dtype == t.dtype and torch.equal(stored[name], t), (seq, name)
        slabs = {storage(t) for t in stored.values()}
        assert len(slabs) == (3 if per_tensor else 1)  # one slab per tensor, or one per sequence
    assert len(copier.pinned) == (9 if per_tensor else 3) and copier.pageable == 0
    # each slab is registered on whole pages of its own, holding its tensors (64-byte aligned) inside them
    assert sorted(pinning["register"]) == sorted((s.data_ptr(), hm.PAGE) for s in copier.pinned)
    ptrs = [ptr for ptr, _ in pinning["register"]]
    assert all(ptr % hm.PAGE == 0 for ptr in ptrs) and len(set(ptrs)) == len(ptrs)  # no page pinned twice
    for stored in copied.values():
        for t in stored.values():
            ptr = next(p for p, n in pinning["register"] if p <= t.data_ptr() < p + n)
            assert t.data_ptr() % 64 == 0 and t.data_ptr() + t.numel() * t.element_size() <= ptr + hm.PAGE
    # each host tensor's storage is exactly one registered range: torch's is_pinned asks about the storage's base
    registered = set(pinning["register"])
    assert all(s.untyped_storage().data_ptr() == s.data_ptr() for s in copier.pinned)
    assert all((storage(t), t.untyped_storage().nbytes()) in registered for d in copied.values() for t in d.values())
    assert not pinning["cleared"]
    copier.release()
    assert sorted(pinning["unregister"]) == sorted(p for p, _ in pinning["register"]) and not copier.pinned
    assert torch.equal(copied[2]["key.0"], sequence(2)["key.0"])  # the memory stays with the tensors


def test_page_aligned_bytes_are_a_private_map_of_their_own_freed_with_the_last_tensor():
    t = hm.page_aligned_bytes(hm.PAGE + 1)
    base = t.untyped_storage().data_ptr()
    assert t.numel() == 2 * hm.PAGE and base == t.data_ptr() and base % hm.PAGE == 0 and not t.any()
    assert hm.page_aligned_bytes(0).numel() == hm.PAGE

    def mapping(addr: int) -> str | None:  # the permissions of the mapping holding addr (rw-p: private)
        for line in open("/proc/self/maps"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line.split()[1]
        return None

    assert mapping(base) == "rw-p"
    view = t[hm.PAGE:]
    del t
    gc.collect()
    view.fill_(7)  # a view keeps the map alive
    assert mapping(base) == "rw-p" and int(view.sum()) == 7 * hm.PAGE
    del view
    gc.collect()
    assert mapping(base) is None  # the last tensor gone: unmapped


def test_a_failed_pin_falls_back_to_pageable_copies_and_clears_the_cuda_error(pinning, monkeypatch):
    """cudaHostRegister returns an error (2, out of memory): the slab is not pinned nor kept by the copier,
    the copy is the same, and the thread that pinned clears its pending CUDA error right away."""
    monkeypatch.setattr(hm, "_register", lambda ptr, nbytes: pinning["register"].append((ptr, nbytes)) or 2)
    copier = hm.HostCopier(CPU)
    copied = copy_all(copier, range(2))
    assert all(torch.equal(copied[s][n], t) for s in range(2) for n, t in sequence(s).items())
    assert not copier.pinned and copier.pageable == 2 and len(pinning["register"]) == 2
    assert pinning["cleared"] == ["loopvq-capture-copy_0"] * 2  # by the worker that pinned, once per slab
    assert copier.drop_unused(0, None) == 0 and not pinning["unregister"]


def test_pinning_without_a_cuda_runtime_is_a_pageable_copy(monkeypatch):
    def no_runtime(ptr, nbytes):
        raise AssertionError("Torch not compiled with CUDA enabled")

    cleared = []
    monkeypatch.setattr(hm, "_register", no_runtime)
    monkeypatch.setattr(hm, "_clear_cuda_error", lambda: cleared.append(1))
    assert hm._pin(torch.zeros(64, dtype=torch.uint8)) is False and not cleared  # no call made, nothing pending


def test_the_cuda_runtime_is_found_in_the_process_maps():
    maps = ("7f0a1000-7f0a2000 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7f0b0000-7f0b8000 r--p 00000000 08:01 5678 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/"
            "libcudart.so.13\n"
            "7f0c0000-7f0c1000 rw-p 00000000 00:00 0 \n")
    assert hm.cudart_path(maps) == "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    assert hm.cudart_path(maps.replace("libcudart.so.13", "libcudart_static_helper.so")) is None
    hashed = maps.replace("nvidia/cu13/lib/libcudart.so.13", "torch/lib/libcudart-9335f6a2.so.12")
    assert hm.cudart_path(hashed) == "/venv/lib/python3.12/site-packages/torch/lib/libcudart-9335f6a2.so.12"
    assert hm.cudart_path("7f0b0000-7f0b8000 r--p 00000000 08:01 5678 /opt/cuda with space/libcudart.so\n") \
        == "/opt/cuda with space/libcudart.so"


def test_at_most_depth_sequences_are_in_flight(monkeypatch):
    """With the worker held, two submits return at once; the third waits until a copy is done."""
    gate, started = threading.Event(), []
    real = hm.HostCopier._slab

    def held(self, nbytes, seq):
        started.append(nbytes)
        assert gate.wait(30)
        return real(self, nbytes, seq)

    monkeypatch.setattr(hm.HostCopier, "_slab", held)
    copier = hm.HostCopier(CPU, depth=2)
    first = [copier.submit(sequence(seq), seq) for seq in range(2)]
    third = threading.Thread(target=lambda: first.append(copier.submit(sequence(2), 2)))
    third.start()
    third.join(0.5)
    waited = third.is_alive() and len(first) == 2 and not any(f.done() for f in first) and len(started) == 1
    gate.set()
    assert waited
    third.join(30)
    assert not third.is_alive() and len(first) == 3 and first[0].done()  # it waited for the oldest copy
    copier.finish()
    assert [torch.equal(f.result()["key.0"], sequence(s)["key.0"]) for s, f in enumerate(first)] == [True] * 3
    assert copier.seconds["waiting"] >= 0.4


def test_a_failed_copy_surfaces_in_the_caller_naming_its_sequence(monkeypatch):
    real = hm.HostCopier._slab

    def out_of_memory_at_sequence_1(self, nbytes, seq):
        if fail.is_set():
            raise MemoryError("cannot allocate host memory")
        return real(self, nbytes, seq)

    fail = threading.Event()
    monkeypatch.setattr(hm.HostCopier, "_slab", out_of_memory_at_sequence_1)
    copier = hm.HostCopier(CPU, depth=1)
    assert torch.equal(copier.submit(sequence(0), 0).result()["key.0"], sequence(0)["key.0"])
    fail.set()
    failing = copier.submit(sequence(1), 1)
    with pytest.raises(hm.HostCopyError, match="copying calibration sequence 1 to host memory failed: MemoryError: "
                                               "cannot allocate host memory"):
        copier.submit(sequence(2), 2)  # waits for sequence 1 (depth 1): its error comes out here
    with pytest.raises(hm.HostCopyError, match="sequence 1 "):
        failing.result()
    copier.finish()


def test_leaving_the_copier_after_an_error_cancels_the_copies_not_started(monkeypatch):
    """An error in the caller's loop while the worker copies sequence 0: leaving the ``with`` lets that copy
    finish and cancels sequences 1 and 2."""
    gate, copied = threading.Event(), []
    real = hm.HostCopier._slab

    def held(self, nbytes, seq):
        assert gate.wait(30)
        copied.append(nbytes)
        return real(self, nbytes, seq)

    monkeypatch.setattr(hm.HostCopier, "_slab", held)
    futures = []
    with pytest.raises(KeyError, match="capture failed"):
        with hm.HostCopier(CPU, depth=3) as copier:
            futures += [copier.submit(sequence(seq), seq) for seq in range(3)]
            threading.Timer(1.0, gate.set).start()  # the worker stays on sequence 0 until after the cancelling
            raise KeyError("capture failed")
    assert futures[0].done() and not futures[0].cancelled() and torch.equal(futures[0].result()["key.0"],
                                                                            sequence(0)["key.0"])
    assert [f.cancelled() for f in futures[1:]] == [True, True] and len(copied) == 1


def test_dropped_tensors_release_their_pinned_slabs(pinning):
    """Slab per tensor (several processes): dropping a sequence's tensors, then drop_unused, unpins exactly their
    slabs and the copier lets go of them; the kept tensors stay pinned and unchanged."""
    copier = hm.HostCopier(CPU, slab_per_tensor=True)
    copied = copy_all(copier, range(2))
    refs = {s.data_ptr(): weakref.ref(s) for s in copier.pinned}
    dropped = {copied[s][n].data_ptr() for s in range(2) for n in ("fisher_key.0", "input_ids")}  # = their slabs'
    for stored in copied.values():
        del stored["fisher_key.0"], stored["input_ids"]
    assert copier.drop_unused(0, copied[0]) == 2 * hm.PAGE  # their slabs' bytes
    assert len(copier.slabs[0]) == 1 and len(copier.slabs[1]) == 3  # sequence 1's slabs are not looked at
    assert copier.drop_unused(1, copied[1]) == 2 * hm.PAGE
    assert set(pinning["unregister"]) == dropped
    assert {s.data_ptr() for s in copier.pinned} == {copied[s]["key.0"].data_ptr() for s in range(2)}
    gc.collect()
    assert {p for p, r in refs.items() if r() is None} == dropped  # nothing holds the dropped slabs any more
    assert all(torch.equal(copied[s]["key.0"], sequence(s)["key.0"]) for s in range(2))
    copier.release()


def test_one_slab_per_sequence_is_released_only_with_its_last_tensor(pinning):
    copier = hm.HostCopier(CPU)
    copied = copy_all(copier, range(2))
    del copied[0]["fisher_key.0"]
    assert copier.drop_unused(0, copied[0]) == 0 and len(copier.pinned) == 2  # a view keeps the whole slab alive
    whole = copied[1]["key.0"].data_ptr()  # the first tensor: at the start of its sequence's slab
    del copied[1]
    assert copier.drop_unused(1, None) == hm.PAGE and pinning["unregister"] == [whole] and len(copier.pinned) == 1
    assert copier.drop_unused(7, None) == 0  # a sequence the copier holds nothing of
    copier.release()


@pytest.mark.gpu
def test_slab_per_tensor_on_a_gpu_pins_each_tensor_and_unpins_the_dropped_ones():
    gpu = {n: t.cuda() for n, t in sequence(3).items()}
    copier = hm.HostCopier(torch.device("cuda"), slab_per_tensor=True)
    with copier:
        host = copier.submit(gpu, 3).result()
    assert all(host[n].is_pinned() and not host[n].is_cuda and torch.equal(host[n], t)
               for n, t in sequence(3).items())
    assert len(copier.pinned) == 3
    del host["fisher_key.0"]
    assert copier.drop_unused(3, host) == hm.PAGE and len(copier.pinned) == 2 and host["key.0"].is_pinned()
    copier.release()
    assert not host["key.0"].is_pinned() and torch.equal(host["key.0"], sequence(3)["key.0"])


def test_clearing_calls_cuda_get_last_error_of_the_loaded_runtime(monkeypatch):
    calls = []

    class Runtime:  # the ctypes library torch loaded
        def cudaGetLastError(self) -> int:
            calls.append(threading.current_thread().name)
            return 2

    monkeypatch.setattr(hm, "_cudart_library", Runtime)
    hm._clear_cuda_error()
    assert calls == [threading.current_thread().name]
    monkeypatch.setattr(hm, "_cudart_library", object)  # a runtime without the symbol: the fallback goes on
    hm._clear_cuda_error()


@pytest.mark.gpu
def test_a_failed_pin_on_a_gpu_leaves_no_cuda_error_pending():
    slab = torch.zeros(1 << 20, dtype=torch.uint8)
    assert hm._pin(slab)
    try:
        assert not hm._pin(slab)  # already registered: cudaErrorHostMemoryAlreadyRegistered
        runtime = hm._cudart_library()
        assert runtime is not None and runtime.cudaPeekAtLastError() == 0
    finally:
        hm._unpin([slab])


@pytest.mark.parametrize("tasq", [False, True])
def test_capture_bytes_is_the_stored_size(tasq):
    model, calib = make_tiny_huginn(), calib_set(n=2, length=16)
    cfg = CaptureConfig(dtype="bfloat16", fisher_channels=4, store="memory")
    mem = MemoryCapture()
    capture_kv(model, calib, model.kv_layout(), cfg=cfg, out=mem, tasq_floor=1e-6 if tasq else None)
    stored = sum(t.numel() * t.element_size() for seq in mem.sequences.values() for t in seq.values())
    assert stored == cs.capture_bytes(model.kv_layout(), 2, 16, cfg=cfg, tasq_keys=tasq)


def test_store_choice_and_refusal(tmp_path, monkeypatch):
    kv = make_tiny_ouro().kv_layout()
    size = cs.capture_bytes(kv, 4, 64, cfg=CaptureConfig(fisher_channels=4))
    choose = lambda store, device="cpu": cs.choose_store(CaptureConfig(store=store, fisher_channels=4), kv, 4, sequence_length=64,
                                                         device=torch.device(device), model_bytes=100, step_bytes=1000, capture_dir=tmp_path)
    monkeypatch.setattr(cs, "host_available", lambda: size)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size - 1)
    auto = choose("auto")
    assert auto.store == "memory" and f"{size / 1e9:.2f} GB" in auto.reason
    with pytest.raises(ConfigError, match="capture.store: disk cannot hold the capture"):
        choose("disk")
    monkeypatch.setattr(cs, "host_available", lambda: size - 1)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size)
    assert choose("auto").store == "disk"
    monkeypatch.setattr(cs, "disk_available", lambda folder: 0)
    with pytest.raises(ConfigError, match="capture.store: no store holds the capture") as err:
        choose("auto")
    assert "4 sequences x 64 tokens" in str(err.value) and "memory:" in str(err.value) and "disk:" in str(err.value)
    # one process, neither alone holds it: the first sequences stay on the accelerator, the rest in host memory;
    # the accelerator keeps room for the copier's 2 sequences in flight to host memory
    per_sequence = cs.capture_bytes(kv, 1, 64, cfg=CaptureConfig(fisher_channels=4))
    device_room = lambda room: monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + room, 2000))
    device_room(per_sequence * 7 // 2)  # weights 100, step 1000 and 5 % of the card 100 come off
    monkeypatch.setattr(cs, "host_available", lambda: per_sequence * 3)
    split = choose("auto", "cuda")
    assert (split.store, split.device_sequences) == ("split", 1)
    assert "1 sequences on cuda, 3 in host memory (with room on cuda for the sequences in flight to it)" in split.reason
    assert f"copies to host memory keep up to 2 sequences ({2 * per_sequence / 1e9:.2f} GB) on cuda" in split.reason
    device_room(per_sequence * 5 // 2)  # 2 sequences would fit, but not next to the 2 in flight
    with pytest.raises(ConfigError, match="no store holds the capture"):
        choose("auto", "cuda")
    # host memory holds it all: chosen only where the accelerator holds the copies in flight, else the disk
    monkeypatch.setattr(cs, "host_available", lambda: size)
    monkeypatch.setattr(cs, "disk_available", lambda folder: size)
    assert choose("auto", "cuda").store == "memory"
    device_room(2 * per_sequence - 1)
    assert choose("auto", "cuda").store == "disk" and choose("auto").store == "memory"  # (no copier on a CPU)
    with pytest.raises(ConfigError, match="capture.store: memory cannot hold the capture: .*in flight"):
        choose("memory", "cuda")
    device_room(size)
    assert (choose("auto", "cuda").store, choose("auto", "cuda").device_sequences) == ("device", 4)


def test_host_memory_store_keeps_gpu_room_only_for_the_sequences_it_can_have_in_flight(tmp_path, monkeypatch):
    """``capture.store: memory`` with one sequence per process (2 processes, 2 sequences): at most one waits on
    the GPU for its copy, so the GPU needs room for one, not two."""
    kv, cfg = make_tiny_ouro().kv_layout(), CaptureConfig(store="memory", fisher_channels=4)
    per_sequence = cs.capture_bytes(kv, 1, 64, cfg=cfg)
    monkeypatch.setattr(cs, "host_available", lambda: 2 * per_sequence)
    choose = lambda: cs.choose_store(cfg, kv, 2, sequence_length=64, device=torch.device("cuda"), model_bytes=100, step_bytes=1000, capture_dir=tmp_path, processes=2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + per_sequence, 2000))
    assert choose().store == "memory" and "keep up to 1 sequences" in choose().reason
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1200 + per_sequence - 1, 2000))
    with pytest.raises(ConfigError, match="memory cannot hold the capture"):
        choose()
def test_let_go_frees_in_a_background_thread():
    """``let_go`` empties the list in its own thread, so the objects only it held are freed there."""
    class Held:
        pass

    freed: list[str] = []
    obj = Held()
    weakref.finalize(obj, lambda: freed.append(threading.current_thread().name))
    held = [obj]
    del obj
    hm.let_go("test objects", held).join()
    assert freed == ["loopvq-release"] and held == []
