"""Clocks: seconds since the process started, and the wall seconds of a stage's phases on a device that runs
ahead of the host."""

from __future__ import annotations

import time

import psutil
import torch


def seconds_since_process_start() -> float:
    """Seconds since this process started (interpreter start-up, imports, config), from the operating system's
    record of the process."""
    return round(time.time() - psutil.Process().create_time(), 2)


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


class DeviceSpan:
    """Seconds a stretch of queued device work takes, read later (:meth:`seconds`) without stopping the host when
    it starts or ends (CUDA events on the device's current stream; on the CPU the host's own seconds)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.events = self.device.type == "cuda"
        if self.events:
            self.begin, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.begin.record(torch.cuda.current_stream(self.device))
        self.start, self.stopped = time.perf_counter(), 0.0

    def stop(self) -> None:
        """The span ends after the work queued so far."""
        if self.events:
            self.end.record(torch.cuda.current_stream(self.device))
        self.stopped = time.perf_counter()

    def seconds(self) -> float:
        """The span's seconds (on CUDA: waits for its end event)."""
        if self.events:
            self.end.synchronize()
            return self.begin.elapsed_time(self.end) / 1000
        return self.stopped - self.start
