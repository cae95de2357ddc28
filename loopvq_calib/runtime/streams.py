"""Device work the host queues without stopping. CUDA performs a copy from pageable host memory only once the
stream's queued work is done, so every such copy of a small index or random tensor stalls the host until the
device is idle; through pinned memory the copy is queued like a kernel (:func:`to_device`). Work queued on one
stream waits behind everything before it there; :class:`SideStream` queues work ahead on a second stream."""

from __future__ import annotations

import contextlib

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: a CPU tensor goes to a CUDA device through pinned memory, queued without waiting for
    the device (a pinned copy made here is reused only once the copy has run; a ``t`` that is already pinned is
    read by the queued copy itself, so the host must not write it until the copy has run); anything else as
    ``t.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SideStream:
    """A second CUDA stream on which the host queues work ahead (k-means: the next layouts' problems and
    seeding) while the current stream runs other work (a Lloyd loop that stops the host at every step).

    Work queued in :meth:`queue` starts after everything queued on the current stream before the side stream
    was made; :meth:`mark` records where a piece of it ends and :meth:`take` hands its tensors to the current
    stream. Where there is no CUDA device (or ``enabled`` is False) the work runs in place and the hand-offs
    do nothing."""

    def __init__(self, device: torch.device | str, enabled: bool = True) -> None:
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def queue(self) -> contextlib.AbstractContextManager:
        """Run the block's device work on the side stream."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def mark(self) -> torch.cuda.Event | None:
        """The end of the work queued on the side stream so far (None without a side stream)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def take(self, mark: torch.cuda.Event | None, *tensors: torch.Tensor) -> None:
        """The current stream waits for ``mark``; ``tensors`` (made on the side stream) keep their memory until
        the current stream's work queued on them is done, not only the side stream's."""
        if self.stream is None or mark is None:
            return
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_event(mark)
        for t in tensors:
            t.record_stream(current)
