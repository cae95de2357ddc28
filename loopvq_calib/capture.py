"""Capture stage: pre-RoPE keys and values at every KV site, their empirical Fisher, query statistics.

One safetensors file per calibration sequence (``seq00000.safetensors`` ...) holds, per site s:
``key.{s}`` / ``value.{s}`` [S, H, D], ``fisher_key.{s}`` / ``fisher_value.{s}`` [S, H, D] (squared
gradients of the sequence's summed next-token loss, flowing through every later loop step) and
``qstat.{s}`` [H, D] fp32 (TaSQ's query statistic, summed), plus ``input_ids`` [S]. ``meta.json``
describes the capture. Later stages read it block by block (:class:`CaptureReader`), so memory stays
bounded by one block's data, never the whole capture.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from .config import CaptureConfig
from .data import CalibrationSet
from .models.common import apply_rope, rope_angles
from .models.sites import KVLayout, KVRecorder, kv_hook

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CaptureError(RuntimeError):
    """A captured tensor is unusable (non-finite values); names the site and sequence."""


class QueryStats:
    """Per sequence, site and KV head: the sum over causal pairs (i >= j) of diag(R_j^T q_i q_i^T R_j)
    for the post-RoPE query q_i and the RoPE rotation R_j at the key position (GQA query heads averaged).
    Prefix sums over j make it O(S) per site."""

    def __init__(self, kv: KVLayout) -> None:
        self.kv = kv
        self.sums: dict[int, torch.Tensor] = {}  # site -> [B, H_kv, D]

    def __call__(self, site: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        kv = self.kv
        with torch.no_grad():
            b, s, hq, d = q.shape
            cos, sin = rope_angles(positions, d, kv.rope_theta)  # [B, S, D/2]
            qr = apply_rope(q.float(), cos, sin, kv.rope_style)  # post-RoPE queries
            if kv.rope_style == "half":
                qa, qb = qr[..., : d // 2], qr[..., d // 2 :]
            else:
                qa, qb = qr[..., 0::2], qr[..., 1::2]
            c2, s2, cs = (t.cumsum(1)[:, :, None, :] for t in (cos * cos, sin * sin, cos * sin))
            da = (c2 * qa * qa + s2 * qb * qb + 2 * cs * qa * qb).sum(dim=1)  # [B, Hq, D/2]
            db = (c2 * qb * qb + s2 * qa * qa - 2 * cs * qa * qb).sum(dim=1)
            diag = torch.zeros(b, hq, d, device=q.device)
            if kv.rope_style == "half":
                diag[..., : d // 2], diag[..., d // 2 :] = da, db
            else:
                diag[..., 0::2], diag[..., 1::2] = da, db
            self.sums[site] = diag.view(b, kv.kv_heads, hq // kv.kv_heads, d).mean(2).cpu()


def _check_finite(tensors: dict[str, torch.Tensor], kv: KVLayout, seq: int) -> None:
    """Forward values first, in site order, so the first bad site (not its gradient echo) is named."""
    order = [(k, s) for kinds in (("key", "value"), ("fisher_key", "fisher_value")) for s in kv.sites for k in kinds]
    for kind, site in order:
        t = tensors.get(f"{kind}.{site.site}")
        if t is not None and not torch.isfinite(t).all():
            raise CaptureError(
                f"non-finite values in {kind} at site {site.site} (loop step {site.step}, layer {site.layer}, "
                f"{site.stage}), calibration sequence {seq}"
            )


def capture_sequence(model: torch.nn.Module, ids: torch.Tensor, kv: KVLayout) -> tuple[dict[str, torch.Tensor], ...]:
    """One forward + backward over ``ids`` [B, S]; returns per-sequence tensor dicts (on CPU, fp32)."""
    rec = KVRecorder(fisher=True)
    qstats = QueryStats(kv)
    model.query_observer = qstats
    try:
        with kv_hook(model, rec), torch.enable_grad():
            logits = model(ids, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
            loss.backward()
    finally:
        model.query_observer = None
    fisher = rec.fisher()
    out = []
    for b in range(ids.shape[0]):
        t: dict[str, torch.Tensor] = {"input_ids": ids[b].cpu()}
        for site in rec.keys:
            t[f"key.{site}"] = rec.keys[site][b].float().cpu()
            t[f"value.{site}"] = rec.values[site][b].float().cpu()
            t[f"fisher_key.{site}"] = fisher[site][0][b].float().cpu()
            t[f"fisher_value.{site}"] = fisher[site][1][b].float().cpu()
        t.update({f"qstat.{site}": v[b].float() for site, v in qstats.sums.items()})
        out.append(t)
    return tuple(out)


def capture_kv(
    model: torch.nn.Module,
    calib: CalibrationSet,
    kv: KVLayout,
    cfg: CaptureConfig,
    out_dir: Path,
    rank: int = 0,
    world: int = 1,
    progress: Callable[[int], Any] | None = None,
) -> list[int]:
    """Capture the sequences of this process (``i % world == rank``) into ``out_dir``; returns their ids.

    Files are written under a temporary name and renamed, so a killed run leaves no partial shard.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    mine = [i for i in range(calib.input_ids.shape[0]) if i % world == rank]
    dtype = DTYPES[cfg.dtype]
    for start in range(0, len(mine), cfg.batch_size):
        batch = mine[start : start + cfg.batch_size]
        results = capture_sequence(model, calib.input_ids[batch].to(device), kv)
        for seq, tensors in zip(batch, results):
            _check_finite(tensors, kv, seq)
            stored = {
                k: (v.to(dtype) if v.is_floating_point() and not k.startswith("qstat") else v).contiguous()
                for k, v in tensors.items()
            }
            tmp = out_dir / f".seq{seq:05d}.tmp{os.getpid()}"
            save_file(stored, str(tmp), metadata={"sequence": str(seq)})
            os.replace(tmp, out_dir / f"seq{seq:05d}.safetensors")
            if progress:
                progress(1)
    return mine


def write_meta(out_dir: Path, calib: CalibrationSet, kv: KVLayout, cfg: CaptureConfig) -> dict[str, Any]:
    """Describe the capture (called once all sequences exist)."""
    meta = {
        "num_sequences": int(calib.input_ids.shape[0]),
        "sequence_length": int(calib.input_ids.shape[1]),
        "sink_tokens": calib.sink_tokens,
        "dtype": cfg.dtype,
        "kv_heads": kv.kv_heads,
        "head_dim": kv.head_dim,
        "loop_steps": kv.loop_steps,
        "rope_style": kv.rope_style,
        "rope_theta": kv.rope_theta,
        "sites": [vars(s) for s in kv.sites],
        "qstat_pairs_per_sequence": calib.input_ids.shape[1] * (calib.input_ids.shape[1] + 1) / 2,
    }
    missing = [i for i in range(meta["num_sequences"]) if not (out_dir / f"seq{i:05d}.safetensors").is_file()]
    if missing:
        raise CaptureError(f"capture incomplete: sequences {missing} have no file in {out_dir}")
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


@dataclass
class CaptureReader:
    """Reads a capture block by block."""

    dir: Path

    def __post_init__(self) -> None:
        self.dir = Path(self.dir)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.files = [self.dir / f"seq{i:05d}.safetensors" for i in range(self.meta["num_sequences"])]

    @property
    def sink_tokens(self) -> int:
        return self.meta["sink_tokens"]

    def load(
        self, name: str, sites: tuple[int, ...], sequences: list[int] | None = None, include_sinks: bool = False
    ) -> torch.Tensor:
        """Tensor ``name`` (key | value | fisher_key | fisher_value) of ``sites`` -> [N, T, H, D] fp32.

        N runs over the tokens of ``sequences`` (default all), sinks excluded unless asked for.
        """
        start = 0 if include_sinks else self.sink_tokens
        parts = []
        for i in sequences if sequences is not None else range(len(self.files)):
            with safe_open(str(self.files[i]), framework="pt") as f:
                parts.append(torch.stack([f.get_tensor(f"{name}.{s}")[start:] for s in sites], dim=1))
        return torch.cat(parts).float()

    def query_stats(self, site: int) -> torch.Tensor:
        """TaSQ's query statistic of ``site``, averaged over causal pairs and sequences -> [H, D]."""
        total = None
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                if f"qstat.{site}" in f.keys():
                    t = f.get_tensor(f"qstat.{site}")
                    total = t if total is None else total + t
        if total is None:
            raise CaptureError(f"capture {self.dir} holds no query statistics for site {site} (qstat.{site})")
        return total / (self.meta["qstat_pairs_per_sequence"] * len(self.files))

    def input_ids(self) -> torch.Tensor:
        out = []
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                out.append(f.get_tensor("input_ids"))
        return torch.stack(out)
