"""Host-to-device copies that do not stop the host. CUDA performs a copy from pageable host memory only once the
stream's queued work is done, so every such copy of a small index or random tensor stalls the host until the
device is idle; through pinned memory the copy is queued like a kernel."""

from __future__ import annotations

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
