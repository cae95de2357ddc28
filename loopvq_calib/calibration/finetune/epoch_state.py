"""Fine-tuning's state after an epoch (``resume.pt``, docs/finetune.md "Resume"), written behind the steps.

The state's accelerator tensors are copied into host buffers allocated once (ahead of the first save, in a
background thread, by :meth:`EpochWriter.prepare`) and reused by every save: pinned on CUDA, so the copies are
queued on the current stream and the training thread does not wait for them; a background thread waits for the
copies and writes the file.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ...runtime.files import remove_temp_siblings, write_atomic
from ...runtime.host_memory import host_buffer

log = logging.getLogger("loopvq_calib")
BUFFERS_NAME = "fine-tune: epoch state"  # how the log names these host buffers


class EpochWriter:
    """Writes the state after an epoch to ``path`` in a background thread while training goes on: the state is
    first copied to host memory, the file is replaced atomically (a kill never leaves half a checkpoint), and
    each save (and :meth:`close`) waits for the previous write and re-raises its error. As a context manager
    it closes on exit; when the block raises, its error wins and a write error is only logged. Temporaries
    that a killed run left beside ``path`` are removed when it is made."""

    def __init__(self, path: Path) -> None:
        self.path, self._thread, self._error = path, None, None
        self._buffers: dict[tuple, torch.Tensor] = {}  # host copies of accelerator tensors, by place in the state
        self._last: dict[str, Any] = {}  # the previous save's host state
        self._preparing: threading.Thread | None = None
        remove_temp_siblings(path)

    def __enter__(self) -> EpochWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except BaseException as e:  # the block's own error is the one to report
            log.warning("fine-tune: the epoch state could not be written: %s", e)

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate, in a background thread, the host buffers for a later :meth:`save` of a state shaped like
        ``state`` (its tensors are not read)."""
        places: dict[tuple, torch.Tensor] = {}
        _cuda_tensors(state, (), places)
        shapes = {place: (t.shape, t.dtype, t.device) for place, t in places.items()}
        self._preparing = threading.Thread(target=self._allocate, args=(shapes,), name="loopvq-epoch-buffers")
        self._preparing.start()

    def _allocate(self, shapes: dict[tuple, tuple[torch.Size, torch.dtype, torch.device]]) -> None:
        """The buffers of :meth:`prepare` (a place left out on an error is allocated by the save)."""
        try:
            for place, (shape, dtype, device) in shapes.items():  # each in its device's context, not cuda:0's
                self._buffers[place] = host_buffer(shape, dtype, device=device, what=BUFFERS_NAME)
        except Exception as e:  # noqa: BLE001 (only a speed-up)
            log.warning("fine-tune: host buffers for the epoch state not prepared: %s", e)

    def save(self, state: dict[str, Any], unchanged: Iterable[str] = ()) -> None:
        """Start writing ``state``; the entries named in ``unchanged`` are the previous save's (the caller
        vouches that they did not change since; their host copies are written again)."""
        self.close()
        devices: set[torch.device] = set()
        host = {
            k: self._last[k] if k in unchanged and k in self._last else self._to_host(v, (k,), devices)
            for k, v in state.items()
        }
        done = [(device, torch.cuda.Event()) for device in devices]
        for device, event in done:
            event.record(torch.cuda.current_stream(device))
        self._last = host
        self._thread = threading.Thread(target=self._write, args=(host, done), name="loopvq-epoch-state")
        self._thread.start()

    def close(self) -> None:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _to_host(self, obj: Any, place: tuple, devices: set[torch.device]) -> Any:
        """A deep copy of ``obj`` with every tensor copied to host memory (training changes the originals): a
        CUDA tensor into its place's reused pinned buffer, queued on its device's current stream (the device
        is added to ``devices``); others at once."""
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "cuda":
                return obj.detach().to("cpu", copy=True)
            buffer = self._buffers.get(place)
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = self._buffers[place] = host_buffer(obj.shape, obj.dtype, device=obj.device, what=BUFFERS_NAME)
            buffer.copy_(obj.detach(), non_blocking=buffer.is_pinned())
            devices.add(obj.device)
            return buffer
        if isinstance(obj, dict):
            return {k: self._to_host(v, (*place, k), devices) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._to_host(v, (*place, i), devices) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _write(self, state: dict[str, Any], done: list[tuple[torch.device, torch.cuda.Event]]) -> None:
        try:
            for device, event in done:  # the copies into the host buffers
                with torch.cuda.device(device):
                    event.synchronize()
            write_atomic(self.path, lambda tmp: torch.save(state, tmp))
        except BaseException as e:  # handed to the training thread by close()
            self._error = e


def _cuda_tensors(obj: Any, place: tuple, found: dict[tuple, torch.Tensor]) -> None:
    """The CUDA tensors of ``obj`` by place (the keys and indices leading to them), into ``found``."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cuda":
            found[place] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _cuda_tensors(v, (*place, k), found)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _cuda_tensors(v, (*place, i), found)
