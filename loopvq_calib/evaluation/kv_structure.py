"""Structure of the KV cache across loop steps (the observation behind LoopVQ, paper Fig. 2b)."""

from __future__ import annotations

import torch


def _standardise(x: torch.Tensor) -> torch.Tensor:
    x = x - x.mean(0, keepdim=True)
    return x / x.norm(dim=0, keepdim=True).clamp_min(1e-12)


def correlation_structure(x: torch.Tensor, group_size: int = 16) -> dict[str, object]:
    """Mean |Pearson r| for one layer's keys or values x [N tokens, T steps, H heads, D channels].

    ``adjacent_steps[t]``: same channel, steps t and t+1, averaged over heads and channels.
    ``within_group``: different channels of one ``group_size``-channel group (consecutive channels),
    same step, averaged over steps, heads, groups and channel pairs.
    """
    z = _standardise(x.double())  # unit-norm columns: dot products are correlations
    n, t, h, d = z.shape
    adjacent = [(z[:, s] * z[:, s + 1]).sum(0).abs().mean().item() for s in range(t - 1)]
    groups = z.reshape(n, t * h * (d // group_size), group_size)
    corr = torch.einsum("ngi,ngj->gij", groups, groups).abs()
    off = ~torch.eye(group_size, dtype=torch.bool)
    return {
        "adjacent_steps": adjacent,
        "adjacent_mean": sum(adjacent) / len(adjacent) if adjacent else float("nan"),
        "within_group": corr[:, off].mean().item(),
    }


def average_structure(per_layer: list[dict[str, object]]) -> dict[str, object]:
    """Average :func:`correlation_structure` results over layers."""
    steps = len(per_layer[0]["adjacent_steps"])
    adjacent = [sum(r["adjacent_steps"][s] for r in per_layer) / len(per_layer) for s in range(steps)]
    return {
        "adjacent_steps": adjacent,
        "adjacent_mean": sum(adjacent) / steps,
        "within_group": sum(r["within_group"] for r in per_layer) / len(per_layer),
        "layers": len(per_layer),
    }
