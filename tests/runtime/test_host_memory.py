"""Host memory: page-aligned slabs, the pinning thread (every registration on it, a refused one a pageable copy,
no slab held after a call), host buffers, and the HostCopier (capture to host memory behind the capture): slabs,
depth, errors, releasing the slabs of dropped tensors. On a CPU the copier runs its worker with no stream and
copies host tensors; the pinner's CUDA calls are replaced by recorders (a CPU has nothing to lock)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import pytest
import torch

import loopvq_calib.runtime.host_memory as hm

CPU = torch.device("cpu")


def sequence(seq: int) -> dict[str, torch.Tensor]:
    """A captured sequence's tensors: distinct values per sequence and tensor, sizes not multiples of 64 bytes."""
    return {
        "key.0": torch.arange(30, dtype=torch.float32).view(5, 6) + 100 * seq,
        "fisher_key.0": torch.arange(21, dtype=torch.bfloat16).view(7, 3) + seq,
        "input_ids": torch.arange(5) * (seq + 1),
    }


class Recorder:
    """The CUDA runtime's register/unregister calls, recorded with the thread that made them; ``result``: what
    registration returns (0 success, 2 out of memory)."""

    def __init__(self, result: int = 0) -> None:
        self.result, self.register, self.unregister, self.threads = result, [], [], set()

    def registering(self, ptr: int, nbytes: int) -> int:
        self.register.append((ptr, nbytes))
        self.threads.add(threading.current_thread().name)
        return self.result

    def unregistering(self, ptr: int) -> int:
        self.unregister.append(ptr)
        self.threads.add(threading.current_thread().name)
        return 0

    def pinner(self) -> hm.HostPinner:
        return hm.HostPinner(self.registering, self.unregistering)


def copy_all(copier: hm.HostCopier, seqs: range) -> dict[int, dict[str, torch.Tensor]]:
    with copier:
        futures = {seq: copier.submit(sequence(seq), seq) for seq in seqs}
        return {seq: f.result() for seq, f in futures.items()}


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("per_tensor", [False, True])
def test_copies_hold_the_values_in_slabs_locked_on_the_pinning_thread(per_tensor):
    calls = Recorder()
    copier = hm.HostCopier(CPU, slab_per_tensor=per_tensor, pinner=calls.pinner())
    copied = copy_all(copier, range(3))
    for seq, stored in copied.items():
        for name, t in sequence(seq).items():
            assert stored[name].dtype == t.dtype and torch.equal(stored[name], t), (seq, name)
        slabs = {storage(t) for t in stored.values()}
        assert len(slabs) == (3 if per_tensor else 1)  # one slab per tensor, or one per sequence
    assert len(copier.pinned) == (9 if per_tensor else 3) and copier.pageable == 0
    # each slab is registered on whole pages of its own, holding its tensors (64-byte aligned) inside them
    assert sorted(calls.register) == sorted((s.data_ptr(), hm.PAGE) for s in copier.pinned)
    ptrs = [ptr for ptr, _ in calls.register]
    assert all(ptr % hm.PAGE == 0 for ptr in ptrs) and len(set(ptrs)) == len(ptrs)  # no page locked twice
    for stored in copied.values():
        for t in stored.values():
            ptr = next(p for p, n in calls.register if p <= t.data_ptr() < p + n)
            assert t.data_ptr() % 64 == 0 and t.data_ptr() + t.numel() * t.element_size() <= ptr + hm.PAGE
    # each host tensor's storage is exactly one registered range: torch's is_pinned asks about the storage's base
    registered = set(calls.register)
    assert all(s.untyped_storage().data_ptr() == s.data_ptr() for s in copier.pinned)
    assert all((storage(t), t.untyped_storage().nbytes()) in registered for d in copied.values() for t in d.values())
    copier.release()
    assert sorted(calls.unregister) == sorted(p for p, _ in calls.register) and not copier.pinned
    assert calls.threads == {hm.PINNING_THREAD}  # not the copier's worker, not this thread
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
    view = t[hm.PAGE :]
    del t
    gc.collect()
    view.fill_(7)  # a view keeps the map alive
    assert mapping(base) == "rw-p" and int(view.sum()) == 7 * hm.PAGE
    del view
    gc.collect()
    assert mapping(base) is None  # the last tensor gone: unmapped


def test_a_refused_registration_is_a_pageable_copy_made_on_the_pinning_thread():
    """cudaHostRegister returns an error (2, out of memory): the slab is not kept by the copier, the copy is the
    same, and the refused call was made on the pinning thread only (where no kernel is launched to read it)."""
    calls = Recorder(result=2)
    copier = hm.HostCopier(CPU, pinner=calls.pinner())
    copied = copy_all(copier, range(2))
    assert all(torch.equal(copied[s][n], t) for s in range(2) for n, t in sequence(s).items())
    assert not copier.pinned and copier.pageable == 2 and len(calls.register) == 2
    assert calls.threads == {hm.PINNING_THREAD}
    assert copier.drop_unused(0, None) == 0 and not calls.unregister


def test_locking_without_a_cuda_runtime_is_a_pageable_copy():
    def no_runtime(ptr: int, nbytes: int) -> int:
        raise AssertionError("Torch not compiled with CUDA enabled")

    assert hm.HostPinner(no_runtime).pin(torch.zeros(64, dtype=torch.uint8), CPU) is False
    copier = hm.HostCopier(CPU, pinner=hm.HostPinner(no_runtime))
    assert torch.equal(copy_all(copier, range(1))[0]["key.0"], sequence(0)["key.0"]) and copier.pageable == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA runtime locks the memory")
def test_the_default_pinner_without_cuda_locks_nothing():
    assert hm.HOST_PINNER.pin(torch.zeros(64, dtype=torch.uint8), CPU) is False
    assert hm.HostCopier(CPU).pinner is None  # a CPU copier locks nothing unless given a pinner


def test_the_pinner_holds_no_slab_after_a_call_and_raises_the_runtimes_errors_in_the_caller():
    calls = Recorder()
    pinner = calls.pinner()
    slab = hm.page_aligned_bytes(1)
    gone = weakref.ref(slab)
    assert pinner.pin(slab, CPU)
    pinner.unpin([slab], CPU)
    assert calls.unregister == [slab.data_ptr()]
    del slab
    gc.collect()
    assert gone() is None  # the thread, waiting for the next request, keeps none of the last one

    def refuses(ptr: int) -> int:
        raise ValueError(f"cannot unregister {ptr}")

    with pytest.raises(ValueError, match="cannot unregister"):
        hm.HostPinner(calls.registering, refuses).unpin([torch.zeros(1)], CPU)


def test_a_call_made_on_the_pinning_thread_itself_runs_in_place():
    """A finalizer that the garbage collector runs on the pinning thread unlocks its slabs there, without waiting
    for the thread (itself)."""
    calls = Recorder()
    inner = torch.zeros(8)

    def register_then_unlock_another(ptr: int, nbytes: int) -> int:
        pinner.unpin([inner], CPU)  # as a finalizer run by the garbage collector in this call
        return calls.registering(ptr, nbytes)

    pinner = hm.HostPinner(register_then_unlock_another, calls.unregistering)
    result = []
    caller = threading.Thread(target=lambda: result.append(pinner.pin(torch.zeros(8), CPU)), daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive() and result == [True] and calls.unregister == [inner.data_ptr()]


def test_host_buffer_off_cuda_is_a_plain_host_tensor():
    buffer = hm.host_buffer((3, 4), torch.bfloat16, device=CPU)
    assert buffer.shape == (3, 4) and buffer.dtype == torch.bfloat16 and buffer.device == CPU


def test_host_buffer_is_pageable_where_pinning_fails_and_says_so(monkeypatch, caplog):
    real, asked = torch.empty, []

    def empty(*shape, pin_memory: bool = False, **kwargs):
        asked.append(pin_memory)
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real(*shape, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        buffer = hm.host_buffer((4,), torch.int64, device=torch.device("cuda", 0), what="the epoch state")
    assert buffer.shape == (4,) and buffer.dtype == torch.int64 and asked == [True, False]
    assert "the epoch state: pageable host memory (pinning failed: CUDA error: out of memory)" in caplog.text


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
    with pytest.raises(
        hm.HostCopyError,
        match="copying calibration sequence 1 to host memory failed: MemoryError: cannot allocate host memory",
    ):
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
    assert (
        futures[0].done()
        and not futures[0].cancelled()
        and torch.equal(futures[0].result()["key.0"], sequence(0)["key.0"])
    )
    assert [f.cancelled() for f in futures[1:]] == [True, True] and len(copied) == 1


def test_dropped_tensors_release_their_locked_slabs():
    """Slab per tensor (several processes): dropping a sequence's tensors, then drop_unused, unlocks exactly their
    slabs and the copier lets go of them; the kept tensors stay locked and unchanged."""
    calls = Recorder()
    copier = hm.HostCopier(CPU, slab_per_tensor=True, pinner=calls.pinner())
    copied = copy_all(copier, range(2))
    refs = {s.data_ptr(): weakref.ref(s) for s in copier.pinned}
    dropped = {copied[s][n].data_ptr() for s in range(2) for n in ("fisher_key.0", "input_ids")}  # = their slabs'
    for stored in copied.values():
        del stored["fisher_key.0"], stored["input_ids"]
    assert copier.drop_unused(0, copied[0]) == 2 * hm.PAGE  # their slabs' bytes
    assert len(copier.slabs[0]) == 1 and len(copier.slabs[1]) == 3  # sequence 1's slabs are not looked at
    assert copier.drop_unused(1, copied[1]) == 2 * hm.PAGE
    assert set(calls.unregister) == dropped
    assert {s.data_ptr() for s in copier.pinned} == {copied[s]["key.0"].data_ptr() for s in range(2)}
    gc.collect()
    assert {p for p, r in refs.items() if r() is None} == dropped  # nothing holds the dropped slabs any more
    assert all(torch.equal(copied[s]["key.0"], sequence(s)["key.0"]) for s in range(2))
    copier.release()


def test_one_slab_per_sequence_is_released_only_with_its_last_tensor():
    calls = Recorder()
    copier = hm.HostCopier(CPU, pinner=calls.pinner())
    copied = copy_all(copier, range(2))
    del copied[0]["fisher_key.0"]
    assert copier.drop_unused(0, copied[0]) == 0 and len(copier.pinned) == 2  # a view keeps the whole slab alive
    whole = copied[1]["key.0"].data_ptr()  # the first tensor: at the start of its sequence's slab
    del copied[1]
    assert copier.drop_unused(1, None) == hm.PAGE and calls.unregister == [whole] and len(copier.pinned) == 1
    assert copier.drop_unused(7, None) == 0  # a sequence the copier holds nothing of
    copier.release()


def test_a_collected_copier_unlocks_its_slabs():
    calls = Recorder()
    copier = hm.HostCopier(CPU, pinner=calls.pinner())
    copied = copy_all(copier, range(2))
    locked = sorted(s.data_ptr() for s in copier.pinned)
    del copier
    gc.collect()
    assert sorted(calls.unregister) == locked and torch.equal(copied[1]["key.0"], sequence(1)["key.0"])


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


@pytest.mark.gpu
def test_slab_per_tensor_on_a_gpu_pins_each_tensor_and_unpins_the_dropped_ones():
    gpu = {n: t.cuda() for n, t in sequence(3).items()}
    copier = hm.HostCopier(torch.device("cuda"), slab_per_tensor=True)
    with copier:
        host = copier.submit(gpu, 3).result()
    assert all(host[n].is_pinned() and not host[n].is_cuda and torch.equal(host[n], t) for n, t in sequence(3).items())
    assert len(copier.pinned) == 3
    del host["fisher_key.0"]
    assert copier.drop_unused(3, host) == hm.PAGE and len(copier.pinned) == 2 and host["key.0"].is_pinned()
    copier.release()
    assert not host["key.0"].is_pinned() and torch.equal(host["key.0"], sequence(3)["key.0"])


@pytest.mark.gpu
def test_host_buffer_on_cuda_is_pinned():
    buffer = hm.host_buffer((1024,), torch.float32, device=torch.device("cuda"))
    assert buffer.is_pinned() and buffer.device == CPU and buffer.shape == (1024,)


@pytest.mark.gpu
def test_a_registration_refused_on_a_gpu_reaches_no_later_kernel_launch():
    """The pinner's second registration of a slab is refused (already registered); kernels launched afterwards,
    here and on a copier's worker, run and copy correctly: the refusal's error stayed on the pinning thread."""
    cuda = torch.device("cuda")
    slab = hm.page_aligned_bytes(1 << 20)
    assert hm.HOST_PINNER.pin(slab, cuda)
    try:
        assert not hm.HOST_PINNER.pin(slab, cuda)
        x = torch.ones(1024, device=cuda) * 2
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048
        with hm.HostCopier(cuda) as copier:
            host = copier.submit({"x": x * 3}, 0).result()
        assert torch.equal(host["x"], torch.full((1024,), 6.0)) and host["x"].is_pinned()
        copier.release()
    finally:
        hm.HOST_PINNER.unpin([slab], cuda)
    assert not slab.is_pinned()


@pytest.mark.gpu
def test_a_registration_refused_on_a_thread_is_raised_by_its_next_kernel_launch():
    """Why the pinner has a thread of its own: the same refused registration made on this thread is raised by the
    next kernel launch here (torch reads the runtime's last error of the thread after a launch), and only once."""
    cuda = torch.device("cuda")
    slab = hm.page_aligned_bytes(1 << 20)
    assert hm.HOST_PINNER.pin(slab, cuda)
    try:
        assert int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0)) != 0
        with pytest.raises(RuntimeError, match="already"):
            torch.ones(1024, device=cuda).mul_(2)
            torch.cuda.synchronize()
        assert float((torch.ones(1024, device=cuda) * 2).sum()) == 2048  # reading it cleared it
    finally:
        hm.HOST_PINNER.unpin([slab], cuda)
