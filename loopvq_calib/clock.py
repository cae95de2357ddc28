"""Stage instrumentation: wall seconds of a stage's phases on a device that runs ahead of the host."""

from __future__ import annotations

import time

import torch


class DeviceClock:
    """Seconds between calls to :meth:`lap`, the work queued on the device's current stream finished first
    (CUDA runs ahead; other streams, e.g. the capture's host copies, are not waited for)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.last = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        start, self.last = self.last, time.perf_counter()
        return self.last - start
