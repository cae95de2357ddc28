"""A calibrated KV quantizer: every (kind, block) codec of a model plus what a reader needs to know.

Stage outputs (kmeans, finetune) and bundles store it the same way: tensors from :meth:`KVQuantizer.tensors`
(``{kind}.{block}.codebook`` / ``.groups`` / ``key.{block}.tasq_weight``) and the JSON from
:meth:`KVQuantizer.meta`; docs/bundle-format.md specifies both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config.methods import get_method
from ..models.sites import KVLayout
from .codec import BlockCodec, TasqTransform, code_bits, sigma_bits
from .layouts import BlockLayout


@dataclass
class KVQuantizer:
    """All block codecs of a model, keyed by ``"{kind}.{block}"``."""

    codecs: dict[str, BlockCodec]
    method: str
    codebook_size: int
    group_size: int
    steps_per_block: int
    sharing: str
    kv: KVLayout

    def quantize_sites(
        self, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], dtype: torch.dtype | None = None
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """decode(encode(.)) of every site's keys/values [B, S, H, D]; differentiable w.r.t. codebooks.
        ``dtype``: cast each block's result to it once (the dtype the forward's keys and values have), not
        per site where they are used; the same values."""
        out = {"key": {}, "value": {}}
        src = {"key": keys, "value": values}
        for codec in self.codecs.values():
            lay = codec.layout
            first = src[lay.kind][lay.sites[0]]
            b, s = first.shape[:2]
            x = torch.stack([src[lay.kind][site].reshape(b * s, *first.shape[2:]) for site in lay.sites], dim=1)
            y = codec.quantize(x)
            if dtype is not None:
                y = y.to(dtype)
            for site, part in zip(lay.sites, y.unbind(1)):  # one backward copy per block, not one per site
                out[lay.kind][site] = part.reshape(first.shape)
        return out["key"], out["value"]

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps may attend from these codes in the fused kernels (the method's declaration says)."""
        return get_method(self.method).fused_decode

    def parameters(self) -> list[torch.Tensor]:
        """Every codec's codebook."""
        return [c.codebook for c in self.codecs.values()]

    def bits(self) -> dict[str, float]:
        """Bits per element of keys and values, TaSQ's fp16 sigma included."""
        base = code_bits(self.codebook_size, self.group_size)
        has_sigma = any(c.transform is not None for c in self.codecs.values())
        return {"key": base + (sigma_bits(self.kv.kv_heads, self.kv.head_dim) if has_sigma else 0.0), "value": base}

    def codebook_bytes(self, bytes_per_value: int = 2) -> int:
        """Codebook memory (weights-like) at the stored precision."""
        return sum(c.codebook.numel() * bytes_per_value for c in self.codecs.values())

    def tensors(self, codebook_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The stored tensors (contiguous, on the CPU): codebooks in ``codebook_dtype``, groups int32, TaSQ
        weights fp32."""
        out = {}
        for key, c in self.codecs.items():
            out[f"{key}.codebook"] = c.codebook.detach().to(codebook_dtype).contiguous().cpu()
            out[f"{key}.groups"] = c.layout.groups.to(torch.int32).contiguous().cpu()
            if c.transform is not None:
                out[f"{key}.tasq_weight"] = c.transform.weight.float().contiguous().cpu()
        return out

    def meta(self) -> dict[str, Any]:
        """The JSON that describes :meth:`tensors` (method, sizes, KV layout, one entry per block)."""
        blocks = []
        for key, c in self.codecs.items():
            blocks.append(
                {
                    "key": key,
                    "kind": c.layout.kind,
                    "name": c.layout.name,
                    "sites": list(c.layout.sites),
                    "codebook_shape": list(c.codebook.shape),
                    "groups_shape": list(c.layout.groups.shape),
                    "tasq": c.transform is not None,
                    "sigma_min": c.transform.sigma_min if c.transform is not None else None,
                }
            )
        return {
            "method": self.method,
            "codebook_size": self.codebook_size,
            "group_size": self.group_size,
            "steps_per_block": self.steps_per_block,
            "codebook_sharing": self.sharing,
            "kv_layout": self.kv.to_dict(),
            "blocks": blocks,
        }

    @classmethod
    def from_tensors(
        cls, meta: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> KVQuantizer:
        """The quantizer :meth:`meta` and :meth:`tensors` describe, codebooks in ``dtype``."""
        kv = KVLayout.from_dict(meta["kv_layout"])
        codecs = {}
        for b in meta["blocks"]:
            key = b["key"]
            layout = BlockLayout(
                b["name"], b["kind"], tuple(b["sites"]), kv.head_dim, kv.kv_heads, tensors[f"{key}.groups"].long()
            )
            transform = TasqTransform(tensors[f"{key}.tasq_weight"].float(), b["sigma_min"]) if b["tasq"] else None
            codecs[key] = BlockCodec(layout, tensors[f"{key}.codebook"].to(dtype), transform)
        return cls(
            codecs,
            meta["method"],
            meta["codebook_size"],
            meta["group_size"],
            meta["steps_per_block"],
            meta["codebook_sharing"],
            kv,
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> KVQuantizer:
        """Move codebooks (and TaSQ weights) in place; returns self."""
        for c in self.codecs.values():
            c.codebook = c.codebook.detach().to(device=device, dtype=dtype or c.codebook.dtype)
            c.layout.groups = c.layout.groups.to(device)
            if c.transform is not None:
                c.transform.weight = c.transform.weight.to(device)
        return self


def merge_quantizers(parts: list[KVQuantizer], order: list[str]) -> KVQuantizer:
    """Join quantizers fitted on disjoint sets of layouts (one per process), codecs in ``order``."""
    codecs = {key: codec for part in parts for key, codec in part.codecs.items()}
    missing = [key for key in order if key not in codecs]
    if missing:
        raise ValueError(f"no process fitted the codebooks of {missing}")
    first = parts[0]
    return KVQuantizer(
        {key: codecs[key] for key in order},
        first.method,
        first.codebook_size,
        first.group_size,
        first.steps_per_block,
        first.sharing,
        first.kv,
    )
