"""Device names: one spelling per device, so that per-device records (kernel probes, memory counters) match."""

from __future__ import annotations

import torch


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a CUDA device named without one is the current CUDA device (``cuda`` ->
    ``cuda:0`` where that is current); any other device as it is named."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
