"""``finetune.loop_checkpointing`` during fine-tuning (docs/finetune.md): on, off, or ``auto``.

``auto`` on CUDA starts without activation checkpointing (faster steps, a higher peak) and turns it on for the
rest of the run when a step runs out of GPU memory (the step is undone and redone with checkpointing) or when
the teacher cache, sized beside the peak without checkpointing, would not keep every sequence still asked for
(recomputing them would cost more than checkpointing saves). Checkpointing recomputes the same operations, so
the result does not depend on when it was turned on. On CPU ``auto`` is off.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from ...runtime.device_memory import reset_peak_memory

log = logging.getLogger("loopvq_calib")
GIB = 1 << 30
AUTO_DEVICES = ("cuda",)  # device types where ``auto`` tries steps without checkpointing (tests add "cpu")


def release_cached_memory(device: torch.device) -> None:
    """Hand the blocks the caching allocator holds but no tensor uses back to the device (at fine-tuning's start:
    the capture's and k-means'), then restart the peak counters, so that a peak read later counts only what is
    held from here on (:meth:`TeacherCache.settle`'s sizing; the steps after one that ran out of memory); the
    stage's own recorded peak keeps what came before (:func:`~loopvq_calib.runtime.device_memory.reset_peak_memory`)."""
    with torch.cuda.device(device):
        torch.cuda.empty_cache()
    reset_peak_memory(device)


class LoopPolicy:
    """Activation checkpointing per loop step of ``model`` for the steps run inside the block (the model's
    previous setting is restored on exit); ``setting`` is ``finetune.loop_checkpointing``."""

    def __init__(self, model: torch.nn.Module, setting: bool | str, device: torch.device) -> None:
        self.model, self.device = model, device
        self.auto = setting == "auto" and device.type in AUTO_DEVICES
        self.on = setting is True
        self.reason: str | None = None  # why auto turned checkpointing on
        self._previous = False

    @property
    def trying_off(self) -> bool:
        """``auto`` with checkpointing still off (steps may still switch it on)."""
        return self.auto and not self.on

    def __enter__(self) -> LoopPolicy:
        self._previous, self.model.loop_checkpointing = self.model.loop_checkpointing, self.on
        return self

    def __exit__(self, *exc: Any) -> None:
        self.model.loop_checkpointing = self._previous

    def turn_on(self, reason: str) -> None:
        """Checkpointing on for the remaining steps (``auto``), logged with ``reason``."""
        self.on, self.reason, self.model.loop_checkpointing = True, reason, True
        log.info("fine-tune: loop checkpointing auto -> on for the remaining steps: %s", reason)

    def run_step(self, step: Callable[[], None], undo: Callable[[], None]) -> bool:
        """Run ``step()``. While ``auto`` has checkpointing off, a CUDA out-of-memory error in it is caught: ``undo()``
        puts back what the step changed, the memory it held goes back to the device, the peak statistics are
        reset (the cache is sized from what follows), checkpointing is turned on and the step runs again.
        ``step`` must leave the optimizer and the parameters alone. Returns whether it switched."""
        if not self.trying_off:
            step()
            return False
        try:
            step()
            return False
        except torch.cuda.OutOfMemoryError as e:
            error = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        # out of the except block: the traceback, and the step's tensors its frames held, are gone
        gc.collect()
        undo()
        memory = ""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_reserved(self.device)
            release_cached_memory(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            memory = (
                f"{peak / GIB:.1f} GiB reserved at the peak, {free / GIB:.1f} of {total / GIB:.1f} GiB free "
                "after releasing it; "
            )
        self.turn_on(f"a step without it ran out of GPU memory ({memory}{error}); the step is redone")
        step()
        return True

    def keep_off(self, kept: int, asked: int, peak: int) -> bool:
        """At the teacher cache's sizing, with checkpointing still off under ``auto``: keep it off when the cache
        would keep all ``asked`` sequences (``kept`` of them) beside the ``peak`` without checkpointing; else
        turn it on (the caller sizes the cache after more steps)."""
        if kept >= asked:
            log.info(
                "fine-tune: loop checkpointing auto -> off: the teacher cache keeps all %d sequences beside a "
                "%.1f GiB peak without it",
                asked,
                peak / GIB,
            )
            return True
        self.turn_on(
            f"the teacher cache would keep only {kept} of {asked} sequences beside a {peak / GIB:.1f} GiB "
            "peak without it"
        )
        return False
