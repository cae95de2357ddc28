"""The parts of a fine-tuning recipe besides the loop: which parameters are free, the proximal penalty,
the learning-rate schedule (docs/finetune.md).

``codewords`` trains every codebook entry (the paper), optionally only those that at least
``finetune.min_usage`` training vectors are assigned to by the k-means codebooks; ``affine`` trains a
per-coordinate scale a and shift b of each codebook (one per head and group where codebooks are not
shared), codewords = a * C0 + b: 2G numbers per codebook instead of K x G.
"""

from __future__ import annotations

import math

import torch

from ...codes.codec import flat_codebook_index
from ...codes.objective import Teacher
from ...codes.quantizer import KVQuantizer


class CodebookParams:
    """The free parameters of a quantizer's codebooks and the map from them to the codewords."""

    def __init__(
        self,
        quantizer: KVQuantizer,
        parameterization: str,
        usage: dict[str, torch.Tensor] | None = None,
        *,
        min_usage: int = 0,
    ) -> None:
        self.quantizer, self.mode = quantizer, parameterization
        self.init = {key: c.codebook.detach().clone() for key, c in quantizer.codecs.items()}
        self.init_sq = sum(c.pow(2).sum() for c in self.init.values()).clamp_min(1e-30)
        if parameterization == "affine":
            self.scale = {k: torch.nn.Parameter(torch.ones_like(c[:, :, :1])) for k, c in self.init.items()}
            self.shift = {k: torch.nn.Parameter(torch.zeros_like(c[:, :, :1])) for k, c in self.init.items()}
            self.params = [*self.scale.values(), *self.shift.values()]
        else:
            self.words = {k: torch.nn.Parameter(c.clone()) for k, c in self.init.items()}
            self.params = list(self.words.values())
            if min_usage > 0 and usage is not None:  # Adam moves nothing whose gradient is always zero
                for key, p in self.words.items():
                    keep = (usage[key] >= min_usage).to(p.device, p.dtype)[..., None]
                    p.register_hook(lambda g, keep=keep: g * keep)
        self.apply()

    def codebooks(self) -> dict[str, torch.Tensor]:
        """Every codebook from the current parameters (differentiable)."""
        if self.mode == "affine":
            return {k: c * self.scale[k] + self.shift[k] for k, c in self.init.items()}
        return dict(self.words)

    def apply(self) -> None:
        """Point every codec at the current codewords (differentiable w.r.t. the parameters)."""
        for key, cb in self.codebooks().items():
            self.quantizer.codecs[key].codebook = cb

    def penalty(self, weight: float) -> torch.Tensor:
        """weight x sum ||C - C0||^2 / sum ||C0||^2 over all codebooks (scale-free)."""
        dist = sum((cb - self.init[k]).pow(2).sum() for k, cb in self.codebooks().items())
        return weight * dist / self.init_sq

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A detached copy of the current codebooks."""
        return {k: cb.detach().clone() for k, cb in self.codebooks().items()}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        """Point every codec at the codebooks of a :meth:`snapshot`."""
        for key, cb in state.items():
            self.quantizer.codecs[key].codebook = cb


@torch.no_grad()
def add_usage(quantizer: KVQuantizer, fp: Teacher, sink_tokens: int, *, counts: dict[str, torch.Tensor]) -> None:
    """Add to ``counts[key]`` [Hc, nc, K] how many group vectors of this sequence (after the sinks) each
    codeword of ``quantizer`` is the nearest of."""
    src = {"key": fp.keys, "value": fp.values}
    for key, codec in quantizer.codecs.items():
        lay = codec.layout
        x = torch.stack([src[lay.kind][s][:, sink_tokens:].flatten(0, 1) for s in lay.sites], dim=1)
        idx = codec.encode(x).indices.long()  # [N, H, n]
        rows = flat_codebook_index(idx, codec.codebook).flatten()
        shape = codec.codebook.shape[:3]
        hist = torch.bincount(rows, minlength=math.prod(shape)).view(shape)
        counts[key] = counts.get(key, 0) + hist.cpu()


def lr_factor(step: int, total: int, warmup: int, *, schedule: str) -> float:
    """Multiplier of ``finetune.lr`` for optimizer step ``step`` (0-based) of ``total``: linear warm-up
    (step+1)/warmup over the first ``warmup`` steps, then constant, or a cosine / linear decay from 1
    towards 0 over the remaining steps (progress (step - warmup) / (total - warmup))."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1 - progress
    return 1.0
