"""Host memory for device work: how much is available (:func:`host_available`), host buffers for copies from an
accelerator (:func:`host_buffer`), page-aligned slabs (:func:`page_aligned_bytes`) page-locked in place on one
pinning thread (:class:`HostPinner`), and a worker that copies captured tensors from the accelerator into such
slabs behind the current work (:class:`HostCopier`).

The capture's and the teacher cache's host copies use slabs locked in place rather than torch's pinned allocator
(``pin_memory=True``): a slab's pages are faulted in first by torch's threads (a parallel ``zero_``), so that the
registration only locks them, whereas the driver faults a fresh pinned block in on the one thread that asks for
it; a slab is exactly its tensors' size (the caching host allocator rounds every block up to a power of two) and
is unmapped with its last tensor instead of being kept for reuse. docs/decisions.md gives what this buys.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psutil
import torch

log = logging.getLogger("loopvq_calib")
PAGE = mmap.PAGESIZE
Tensors = dict[str, torch.Tensor]  # one captured sequence's tensors by name
COPY_DEPTH = 2  # sequences a HostCopier holds on the accelerator while they wait for their copy to host memory
Register = Callable[[int, int], int]  # (address, bytes) -> the CUDA runtime's error code (0: success)
Unregister = Callable[[int], int]  # (address) -> the CUDA runtime's error code
PINNING_THREAD = "loopvq-host-pinning"  # the name of HostPinner's thread


def host_available() -> int:
    """Host memory available to new allocations (the kernel's estimate, without swapping), less a tenth of the
    machine's memory."""
    memory = psutil.virtual_memory()
    return memory.available - memory.total // 10


def host_buffer(
    shape: torch.Size | tuple[int, ...], dtype: torch.dtype, *, device: torch.device, what: str = "host copies"
) -> torch.Tensor:
    """An empty host tensor for copies from and to ``device``: on CUDA pinned by torch's caching host allocator
    (in ``device``'s context), so that copies through it are queued without the host waiting; pageable for
    another device, or where pinning fails (logged, naming ``what``; the copies then wait)."""
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype)
    try:
        with _on(device):
            return torch.empty(shape, dtype=dtype, pin_memory=True)
    except RuntimeError as err:
        log.warning("%s: pageable host memory (pinning failed: %s)", what, err)
        return torch.empty(shape, dtype=dtype)


def page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` rounded up to whole pages (at least one), zero-filled, whose storage is a
    private anonymous memory map of its own: storage base = tensor start, page-aligned. The storage holds the
    map, which is unmapped once no tensor uses it any more. Private, as malloc's large blocks: a shared map
    would be shared memory (not inherited copy-on-write by forked workers, and slower to fault in)."""
    size = max(-(-nbytes // PAGE), 1) * PAGE
    return torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def _cuda_register(address: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _cuda_unregister(address: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(address))


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The block's CUDA calls in ``device``'s context (nothing to choose for another device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class HostPinner:
    """Page-locks host memory in place for DMA (``cudaHostRegister`` through torch's public binding of the CUDA
    runtime, ``torch.cuda.cudart()``) and unlocks it, every call made on one thread of its own (started at the
    first call, again after a fork) that makes no other CUDA call than choosing the slab's device.

    Why its own thread: a failed registration (no lockable memory left, a range already registered) leaves its
    error as the CUDA runtime's *last error*, which the runtime keeps per host thread, and torch reads (and
    raises) that error after the next kernel launch of the same thread; torch binds no call that clears it.
    On this thread no kernel is ever launched, so a failed registration's error is never read: the caller only
    gets ``False`` and copies through pageable memory (the same values, slower).

    ``register``/``unregister`` make the calls (the CUDA runtime's by default; tests record them)."""

    def __init__(self, register: Register = _cuda_register, unregister: Unregister = _cuda_unregister) -> None:
        self._register, self._unregister = register, unregister
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: finalizers may queue from anywhere
        self._thread: threading.Thread | None = None
        self._starting = threading.RLock()

    def pin(self, slab: torch.Tensor, device: torch.device) -> bool:
        """Page-lock ``slab``'s memory (the whole of it) for copies with ``device`` -> whether it is locked
        (False: the runtime refused, or there is no CUDA runtime; nothing is pending anywhere either way)."""
        return self._call(self._pin_here, slab, device)

    def unpin(self, slabs: list[torch.Tensor], device: torch.device) -> None:
        """Unlock ``slabs``, each locked by :meth:`pin` with ``device``; returns once they are unlocked."""
        self._call(self._unpin_here, list(slabs), device)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if threading.current_thread() is self._thread:  # a finalizer the garbage collector runs on this thread
            return fn(*args)
        done: Future = Future()
        self._requests.put((done, fn, args))
        with self._starting:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=PINNING_THREAD, daemon=True)
                self._thread.start()
        return done.result()

    def _serve(self) -> None:
        while True:
            done, fn, args = self._requests.get()
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 (raised in the caller's thread)
                done.set_exception(err)
            del done, fn, args  # hold no slab while waiting for the next request

    def _pin_here(self, slab: torch.Tensor, device: torch.device) -> bool:
        try:
            with _on(device):
                return self._register(slab.data_ptr(), slab.numel() * slab.element_size()) == 0
        except Exception:  # noqa: BLE001 (no CUDA runtime: no call made, nothing to pin)
            return False

    def _unpin_here(self, slabs: list[torch.Tensor], device: torch.device) -> None:
        with _on(device):
            for slab in slabs:
                self._unregister(slab.data_ptr())


HOST_PINNER = HostPinner()  # the process's pinning thread


class HostCopyError(RuntimeError):
    """A sequence's copy to host memory failed (names the calibration sequence)."""


class HostCopier:
    """Moves captured sequences from the accelerator to host memory while the next sequences are captured:
    one worker thread copying on its own CUDA stream, at most ``depth`` sequences in flight (each holds its
    tensors on the accelerator until copied). A failed copy raises :class:`HostCopyError` naming its
    sequence, in the caller's thread (at the next :meth:`submit` that waits for it, or from its future).

    Each sequence's tensors go into one host slab of their size (``slab_per_tensor``: one slab per tensor, so
    that dropping a tensor frees its memory, as
    :func:`~loopvq_calib.calibration.capture.kv.share_sequences` does under several processes). A slab is
    faulted in by torch's threads (``zero_``), then locked by ``pinner`` (default: :data:`HOST_PINNER` on a CUDA
    ``device``), so the copies, and later stages' reads back to the accelerator, run at DMA speed; where locking
    fails the copies go through pageable memory (same values). The slabs stay locked until :meth:`drop_unused`
    finds no tensor of their sequence left in them, :meth:`release`, or until the copier is collected. On a CPU
    ``device`` (tests) the worker copies host tensors with no stream and locks nothing unless given a pinner."""

    def __init__(
        self,
        device: torch.device,
        depth: int = COPY_DEPTH,
        slab_per_tensor: bool = False,
        *,
        pinner: HostPinner | None = None,
    ) -> None:
        self.device, self.depth, self.slab_per_tensor = device, depth, slab_per_tensor
        self.pinner = pinner if pinner is not None else HOST_PINNER if device.type == "cuda" else None
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="loopvq-capture-copy")
        self.pending: deque[Future] = deque()
        self.slabs: dict[int, list[torch.Tensor]] = {}  # calibration sequence -> its locked slabs
        self.pageable = 0  # slabs left unlocked
        self.seconds = {"fault_in": 0.0, "pin": 0.0, "copy": 0.0, "waiting": 0.0}
        self._finalizer = weakref.finalize(self, _unpin_all, self.pinner, self.slabs, device)

    @property
    def pinned(self) -> list[torch.Tensor]:
        """Every locked slab, in sequence order."""
        return [slab for seq in sorted(self.slabs) for slab in self.slabs[seq]]

    def __enter__(self) -> HostCopier:
        return self

    def __exit__(self, error_type: type | None, *exc: object) -> None:
        self.finish(cancel=error_type is not None)

    def submit(self, stored: Tensors, seq: int) -> Future:
        """Copy ``stored`` (calibration sequence ``seq``'s tensors on the accelerator, and host ones passed
        through) once the work queued so far on the current stream is done -> a future of the host dict;
        waits while ``depth`` are in flight."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        start = time.perf_counter()
        while len(self.pending) >= self.depth:
            self.pending.popleft().result()
        self.seconds["waiting"] += time.perf_counter() - start
        future = self.pool.submit(self._copy, stored, seq, ready)
        self.pending.append(future)
        return future

    def _copy(self, stored: Tensors, seq: int, ready: torch.cuda.Event | None) -> Tensors:
        try:
            return self._copy_to_slabs(stored, seq, ready)
        except Exception as err:
            raise HostCopyError(
                f"copying calibration sequence {seq} to host memory failed: {type(err).__name__}: {err}"
            ) from err

    def _copy_to_slabs(self, stored: Tensors, seq: int, ready: torch.cuda.Event | None) -> Tensors:
        moving = {k: v for k, v in stored.items() if v.device.type == self.device.type}
        groups = [[k] for k in moving] if self.slab_per_tensor else [list(moving)]
        sizes = {k: -(-v.numel() * v.element_size() // 64) * 64 for k, v in moving.items()}
        slabs = [self._slab(sum(sizes[k] for k in keys), seq) for keys in groups]
        start = time.perf_counter()
        host = dict(stored)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if ready is not None:
                self.stream.wait_event(ready)
            for keys, (slab, pinned) in zip(groups, slabs):
                offset = 0
                for k in keys:
                    v, n = moving[k], moving[k].numel() * moving[k].element_size()
                    host[k] = slab[offset : offset + n].view(v.dtype).view(v.shape)
                    host[k].copy_(v, non_blocking=pinned)
                    offset += sizes[k]
            if self.stream is not None:
                self.stream.synchronize()
        self.seconds["copy"] += time.perf_counter() - start
        return host

    def _slab(self, nbytes: int, seq: int) -> tuple[torch.Tensor, bool]:
        """Host memory for ``nbytes`` on whole pages of its own (locking takes whole pages: a page shared with
        another slab could not be locked for both), faulted in by torch's threads, locked where possible ->
        (slab, locked). The slab is its storage's whole memory, so torch's ``is_pinned`` (which asks about the
        storage's base pointer) sees it pinned, and copies from it to the accelerator take the pinned path."""
        start = time.perf_counter()
        slab = page_aligned_bytes(nbytes)
        slab.zero_()  # already zero: this faults the pages in, on torch's threads
        self.seconds["fault_in"] += time.perf_counter() - start
        start = time.perf_counter()
        pinned = self.pinner is not None and self.pinner.pin(slab, self.device)
        if pinned:
            self.slabs.setdefault(seq, []).append(slab)
        else:
            self.pageable += 1
        self.seconds["pin"] += time.perf_counter() - start
        return slab, pinned

    def finish(self, cancel: bool = False) -> None:
        """Wait for every copy (``cancel``: the one under way only, the others are cancelled) and stop the
        worker (the locked slabs stay)."""
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        self.pending.clear()

    def drop_unused(self, seq: int, stored: Tensors | None) -> int:
        """Unlock and let go of calibration sequence ``seq``'s slabs that none of ``stored`` (its tensors now,
        after some were dropped; None: all dropped) lives in any more; returns their bytes. Only that
        sequence's slabs are looked at (its tensors live in no other). Call once the copies are finished."""
        live = {t.untyped_storage().data_ptr() for t in (stored or {}).values() if t.device.type == "cpu"}
        slabs = self.slabs.pop(seq, [])
        unused = [slab for slab in slabs if slab.data_ptr() not in live]
        if len(unused) < len(slabs):
            self.slabs[seq] = [slab for slab in slabs if slab.data_ptr() in live]
        if unused:
            self.pinner.unpin(unused, self.device)
        return sum(slab.numel() for slab in unused)

    def release(self) -> None:
        """Unlock the slabs (their memory stays with the tensors that use it)."""
        self._finalizer()


def _unpin_all(pinner: HostPinner | None, slabs: dict[int, list[torch.Tensor]], device: torch.device) -> None:
    held = [slab for seq in list(slabs) for slab in slabs.pop(seq)]
    if held:
        pinner.unpin(held, device)


def let_go(what: str, held: list) -> threading.Thread:
    """Empty ``held`` in a background thread: where it holds the last references to its items (the caller
    keeps none but the list), they are freed there. Unlocking and unmapping host memory takes seconds per
    hundred GB, which work on the accelerator need not wait for; the seconds are logged as ``what`` released.
    The interpreter waits for the thread at exit."""

    def release() -> None:
        start = time.perf_counter()
        held.clear()
        log.info("%s released in %.1f s (in the background)", what, time.perf_counter() - start)

    thread = threading.Thread(target=release, name="loopvq-release")
    thread.start()
    return thread
