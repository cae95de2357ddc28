"""Host memory for device work: how much is available, page-aligned slabs pinned for DMA, and a worker that
copies tensors from the accelerator into them behind the current work (:class:`HostCopier`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import re
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import psutil
import torch

log = logging.getLogger("loopvq_calib")
PAGE = mmap.PAGESIZE
Tensors = dict[str, torch.Tensor]  # one captured sequence's tensors by name
COPY_DEPTH = 2  # sequences a HostCopier holds on the accelerator while they wait for their copy to host memory


def host_available() -> int:
    """Host memory available to new allocations (the kernel's estimate, without swapping), less a tenth of the
    machine's memory."""
    memory = psutil.virtual_memory()
    return memory.available - memory.total // 10


class HostCopyError(RuntimeError):
    """A sequence's copy to host memory failed (names the calibration sequence)."""


class HostCopier:
    """Moves captured sequences from the accelerator to host memory while the next sequences are captured:
    one worker thread copying on its own CUDA stream, at most ``depth`` sequences in flight (each holds its
    tensors on the accelerator until copied). A failed copy raises :class:`HostCopyError` naming its
    sequence, in the caller's thread (at the next :meth:`submit` that waits for it, or from its future).

    Each sequence's tensors go into one host slab of their size (``slab_per_tensor``: one slab per
    tensor, so that dropping a tensor frees its memory, as :func:`~loopvq_calib.calibration.capture.kv.share_sequences`
    does under several processes). Fresh host memory costs a page fault per 4 KiB page on first touch,
    which a synchronous copy into it pays one page at a time (Ouro-1.4B on the H200: 41.3 s of capture into
    host memory against 13.3 s on the device); the slab is instead zeroed by torch's threads, then pinned
    (``cudaHostRegister``) so the copies, and later stages' reads back to the accelerator, run at DMA speed
    (there: capture 16.2 s; the worker's 4.3 s of zeroing, 2.9 s of pinning and 0.7 s of copies all behind
    the capture). Where pinning fails the copies go through pageable memory (same values). The slabs stay
    pinned until :meth:`drop_unused` finds no tensor of their sequence left in them, :meth:`release`, or
    until the copier is collected. On a CPU ``device`` (tests) the worker copies host tensors with no stream."""

    def __init__(self, device: torch.device, depth: int = COPY_DEPTH, slab_per_tensor: bool = False) -> None:
        self.device, self.depth, self.slab_per_tensor = device, depth, slab_per_tensor
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="loopvq-capture-copy")
        self.pending: deque[Future] = deque()
        self.slabs: dict[int, list[torch.Tensor]] = {}  # calibration sequence -> its pinned slabs
        self.pageable = 0  # slabs whose pinning failed
        self.seconds = {"fault_in": 0.0, "pin": 0.0, "copy": 0.0, "waiting": 0.0}
        self._finalizer = weakref.finalize(self, _unpin_all, self.slabs)

    @property
    def pinned(self) -> list[torch.Tensor]:
        """Every pinned slab, in sequence order."""
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
            raise HostCopyError(f"copying calibration sequence {seq} to host memory failed: "
                                f"{type(err).__name__}: {err}") from err

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
        """Host memory for ``nbytes`` on whole pages of its own (pinning locks whole pages: a page shared with
        another slab could not be pinned for both), faulted in by torch's threads, pinned where possible ->
        (slab, pinned). The slab is its storage's whole memory, so torch's ``is_pinned`` (which asks about the
        storage's base pointer) sees it pinned, and copies from it to the accelerator take the pinned path."""
        start = time.perf_counter()
        slab = page_aligned_bytes(nbytes)
        slab.zero_()  # already zero: this faults the pages in, on torch's threads
        self.seconds["fault_in"] += time.perf_counter() - start
        start = time.perf_counter()
        pinned = _pin(slab)
        if pinned:
            self.slabs.setdefault(seq, []).append(slab)
        else:
            self.pageable += 1
        self.seconds["pin"] += time.perf_counter() - start
        return slab, pinned

    def finish(self, cancel: bool = False) -> None:
        """Wait for every copy (``cancel``: the one under way only, the others are cancelled) and stop the
        worker (the pinned slabs stay)."""
        self.pool.shutdown(wait=True, cancel_futures=cancel)
        self.pending.clear()

    def drop_unused(self, seq: int, stored: Tensors | None) -> int:
        """Unpin and let go of calibration sequence ``seq``'s slabs that none of ``stored`` (its tensors now,
        after some were dropped; None: all dropped) lives in any more; returns their bytes. Only that
        sequence's slabs are looked at (its tensors live in no other). Call once the copies are finished."""
        live = {t.untyped_storage().data_ptr() for t in (stored or {}).values() if t.device.type == "cpu"}
        slabs = self.slabs.pop(seq, [])
        unused = [slab for slab in slabs if slab.data_ptr() not in live]
        if len(unused) < len(slabs):
            self.slabs[seq] = [slab for slab in slabs if slab.data_ptr() in live]
        freed = sum(slab.numel() for slab in unused)
        _unpin(unused)
        return freed

    def release(self) -> None:
        """Unpin the slabs (their memory stays with the tensors that use it)."""
        self._finalizer()


def let_go(what: str, held: list) -> threading.Thread:
    """Empty ``held`` in a background thread: where it holds the last references to its items (the caller
    keeps none but the list), they are freed there. Unpinning and unmapping host memory takes seconds per
    hundred GB, which work on the accelerator need not wait for; the seconds are logged as ``what`` released.
    The interpreter waits for the thread at exit."""
    def release() -> None:
        start = time.perf_counter()
        held.clear()
        log.info("%s released in %.1f s (in the background)", what, time.perf_counter() - start)

    thread = threading.Thread(target=release, name="loopvq-release")
    thread.start()
    return thread


def page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` rounded up to whole pages (at least one), zero-filled, whose storage is a
    private anonymous memory map of its own: storage base = tensor start, page-aligned. The storage holds the
    map, which is unmapped once no tensor uses it any more. Private, as malloc's large blocks: Python's default
    shared map is shared memory (not inherited copy-on-write by forked workers, and slower to fault in: 0.38
    against 0.26 s per GB on the 2-core dev machine, where this and ``torch.empty`` take the same)."""
    size = max(-(-nbytes // PAGE), 1) * PAGE
    return torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)


def _pin(slab: torch.Tensor) -> bool:
    """Page-lock ``slab`` (cudaHostRegister). Any failure means pageable copies (pinning only speeds them
    up); the failed call's CUDA error is then cleared from this thread, so no later check in it reports it."""
    try:
        if _register(slab.data_ptr(), slab.numel()) == 0:
            return True
    except Exception:  # noqa: BLE001 (no CUDA runtime: nothing to pin, nothing pending)
        return False
    _clear_cuda_error()
    return False


def _register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _unpin_all(slabs: dict[int, list[torch.Tensor]]) -> None:
    try:
        for seq in list(slabs):
            _unpin(slabs[seq])
    finally:
        slabs.clear()


def _unpin(slabs: list[torch.Tensor]) -> None:
    try:
        for slab in slabs:
            _unregister(slab.data_ptr())
    finally:
        slabs.clear()


def _clear_cuda_error() -> None:
    """Reset this thread's last CUDA runtime error (``cudaGetLastError``, which torch does not bind) through
    the runtime library torch loaded; nothing where none is found (a statically linked runtime)."""
    try:
        lib = _cudart_library()
        if lib is not None:
            lib.cudaGetLastError()
    except Exception:  # noqa: BLE001 (the pageable fallback goes on either way)
        pass


@functools.cache
def _cudart_library() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as f:
            path = cudart_path(f.read())
        return ctypes.CDLL(path) if path else None  # the already loaded library (same file): same error state
    except OSError:
        return None


def cudart_path(maps: str) -> str | None:
    """The CUDA runtime library mapped in a process, from its ``/proc/<pid>/maps`` text (``libcudart.so.13``
    of the nvidia wheels, or a wheel's own hashed copy ``libcudart-<hash>.so.12``); None if none is."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and re.search(r"/libcudart(-[0-9a-f]+)?\.so(\.\d+)*$", fields[5].strip()):
            return fields[5].strip()
    return None
