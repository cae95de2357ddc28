"""Peak accelerator memory per stretch of work, kept apart from the readings that restart CUDA's peak counters.

CUDA keeps one peak-memory counter per device (``torch.cuda.max_memory_allocated``/``max_memory_reserved``,
restarted by ``reset_peak_memory_stats``). A stage's record wants its peak since the stage began, while work
inside it wants a "peak since now" reading of its own (fine-tuning sizes its teacher cache from the first
steps' peak). :class:`PeakMeter` serves both: a stage is measured by :meth:`PeakMeter.stage`, and every reset
goes through :meth:`PeakMeter.reset`, which first folds the peak so far into every stage under way, so that a
reset inside a stage never lowers the stage's peak. :data:`PEAKS` is the process's meter of CUDA's counters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from .devices import indexed_device


class PeakCounters(Protocol):
    """A device's peak-memory counters."""

    def available(self) -> bool:
        """Whether there are counters to read (a CUDA device)."""

    def device(self) -> torch.device:
        """The device a stage measures: the current one."""

    def peak_allocated(self, device: torch.device) -> int:
        """The most bytes allocated to tensors on ``device`` since its counters' last reset."""

    def reset(self, device: torch.device) -> None:
        """Restart ``device``'s peak counters (allocated and reserved) from what is held now."""


class CudaCounters:
    """CUDA's peak-memory counters, as torch keeps them."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device(self) -> torch.device:
        return indexed_device(torch.device("cuda"))

    def peak_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)


@dataclass
class StagePeak:
    """The peak of one stage under way on ``device``: ``folded`` is the most its device's counters read before
    any reset inside the stage."""

    device: torch.device
    folded: int = 0
    bytes: int | None = None  # the stage's peak once it ended


class PeakMeter:
    """Per-stage peaks of accelerator memory that resets of the peak counters inside a stage do not lower."""

    def __init__(self, counters: PeakCounters | None = None) -> None:
        self.counters = counters if counters is not None else CudaCounters()
        self._open: list[StagePeak] = []
        self._lock = threading.Lock()

    def reset(self, device: torch.device) -> None:
        """Restart ``device``'s peak counters, for a "peak since now" reading (:func:`torch.cuda.max_memory_reserved`
        and the like), once every stage under way has kept the peak its device reached so far."""
        with self._lock:
            for stage in self._open:
                stage.folded = max(stage.folded, self.counters.peak_allocated(stage.device))
            self.counters.reset(device)

    @contextmanager
    def stage(self) -> Iterator[StagePeak | None]:
        """Measure the block's peak on the current device (None without counters): the most bytes allocated to
        tensors at any time inside it, resets included; set as the yielded record's ``bytes`` when it ends
        (raising or not)."""
        if not self.counters.available():
            yield None
            return
        peak = StagePeak(self.counters.device())
        self.reset(peak.device)
        with self._lock:
            self._open.append(peak)
        try:
            yield peak
        finally:
            with self._lock:
                self._open.remove(peak)
                peak.bytes = max(peak.folded, self.counters.peak_allocated(peak.device))


PEAKS = PeakMeter()  # CUDA's counters of this process


def reset_peak_memory(device: torch.device) -> None:
    """Restart CUDA's peak-memory counters of ``device`` for a reading of the peak from here on, without lowering
    the peak recorded for the stage under way (:data:`PEAKS`)."""
    PEAKS.reset(device)
