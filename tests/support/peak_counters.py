"""Fake peak-memory counters that behave as CUDA's allocated counters (for the per-stage peak tests)."""

from __future__ import annotations

import torch

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class FakeCounters:
    """Per device: bytes held now and the most held since the last reset (as CUDA's allocated counters)."""

    def __init__(self, current: torch.device = CUDA0, available: bool = True) -> None:
        self.current, self.present = current, available
        self.held: dict[torch.device, int] = {}
        self.peak: dict[torch.device, int] = {}

    def available(self) -> bool:
        return self.present

    def device(self) -> torch.device:
        return self.current

    def allocate(self, nbytes: int, device: torch.device = CUDA0) -> None:
        self.held[device] = self.held.get(device, 0) + nbytes
        self.peak[device] = max(self.peak.get(device, 0), self.held[device])

    def peak_allocated(self, device: torch.device) -> int:
        return self.peak.get(device, 0)

    def reset(self, device: torch.device) -> None:
        self.peak[device] = self.held.get(device, 0)
