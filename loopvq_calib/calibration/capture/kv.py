"""Capture stage: pre-RoPE keys and values at every KV site, their empirical Fisher, query statistics.

One safetensors file per calibration sequence (``seq00000.safetensors`` ...) holds, per site s:
``key.{s}`` / ``value.{s}`` [S, H, D], ``fisher_key.{s}`` / ``fisher_value.{s}`` [S, H, D / fisher_channels]
(squared gradients of the sequence's summed next-token loss, flowing through every later loop step; for
TaSQ methods the keys' as F / w^2 summed per RoPE pair, [S, H, D/2], see
:mod:`loopvq_calib.calibration.tasq.stats`) and ``qstat.{s}`` [H, D] fp32 (TaSQ's query statistic, summed),
plus ``input_ids`` [S]. ``meta.json`` describes the capture. Later stages read it block by block
(:class:`~loopvq_calib.calibration.capture.reader.CaptureReader`), so memory stays bounded by one block's data,
never the whole capture.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from ...codes.objective import shared_initial_state
from ...config.schema import CaptureConfig
from ...data.corpus import CalibrationSet
from ...models.loading import TORCH_DTYPES
from ...models.sites import KVLayout, KVRecorder, kv_hook, query_observer
from ...runtime.clock import DeviceClock
from ...runtime.files import remove_temp_siblings, write_bytes_atomic, write_tensors_atomic
from ...runtime.host_memory import HostCopier, let_go
from ...runtime.processes import SINGLE, DistContext
from ..tasq.stats import QueryStats, key_weights, pair_sum, pairs_per_sequence, query_statistics

log = logging.getLogger("loopvq_calib")


class CaptureError(RuntimeError):
    """A captured tensor is unusable (non-finite values); names the site and sequence."""


def _check_finite(tensors: dict[str, torch.Tensor], kv: KVLayout, seq: int) -> None:
    """Forward values first, in site order, so the first bad site (not its gradient echo) is named."""
    order = [
        (k, s)
        for kinds in (("key", "value"), ("fisher_key", "fisher_value"))
        for s in kv.sites
        for k in kinds
        if f"{k}.{s.site}" in tensors
    ]
    finite = torch.stack([torch.isfinite(tensors[f"{k}.{s.site}"]).all() for k, s in order]).tolist()  # one host sync
    for (kind, site), ok in zip(order, finite):
        if not ok:
            raise CaptureError(
                f"non-finite values in {kind} at site {site.site} (loop step {site.step}, layer {site.layer}, "
                f"{site.stage}), calibration sequence {seq}"
            )


def capture_sequence(
    model: torch.nn.Module,
    ids: torch.Tensor,
    kv: KVLayout,
    *,
    seqs: list[int],
    dtype: torch.dtype = torch.float32,
    fisher_channels: int = 1,
    on_device: bool = False,
    tasq_weights: dict[int, torch.Tensor] | None = None,
    query_stats: bool = True,
) -> tuple[dict[str, torch.Tensor], ...]:
    """One forward + backward over ``ids`` [B, S]; per sequence, the tensors to store in ``dtype``, on the
    CPU (or left on the model's device with ``on_device``; query statistics always go to the CPU).

    Values are checked on the device (non-finite -> :class:`CaptureError` naming site and sequence
    ``seqs[b]``). With ``fisher_channels`` c > 1 the squared gradients are summed over c consecutive
    channels ([S, H, D/c]); the reader spreads each sum evenly back over its c channels. With
    ``tasq_weights`` (TaSQ's w [H, D] per site) the keys' Fisher is stored as F / w^2 summed per RoPE pair
    ([S, H, D/2], :func:`~loopvq_calib.calibration.tasq.stats.pair_sum`) and no query statistic is gathered here (the
    caller has them from :func:`~loopvq_calib.calibration.tasq.stats.query_statistics`); ``query_stats=False`` gathers
    none either (methods without TaSQ never read them).
    """
    rec = KVRecorder(fisher=True)
    qstats = QueryStats(kv)
    observing = query_observer(model, qstats) if tasq_weights is None and query_stats else contextlib.nullcontext()
    with kv_hook(model, rec), observing, torch.enable_grad(), shared_initial_state(model):
        logits = model(ids, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
        loss.backward()
    fisher = rec.fisher()
    query_sums = qstats.on_host()

    def chunked(f: torch.Tensor) -> torch.Tensor:
        return f if fisher_channels == 1 else f.unflatten(-1, (-1, fisher_channels)).sum(-1)

    def key_fisher(f: torch.Tensor, site: int) -> torch.Tensor:
        return chunked(f) if tasq_weights is None else pair_sum(f / tasq_weights[site].pow(2), kv.rope_style)

    out = []
    for b, seq in enumerate(seqs):
        t: dict[str, torch.Tensor] = {"input_ids": ids[b]}
        for site in rec.keys:
            t[f"key.{site}"] = rec.keys[site][b]
            t[f"value.{site}"] = rec.values[site][b]
            t[f"fisher_key.{site}"] = key_fisher(fisher[site][0][b], site)
            t[f"fisher_value.{site}"] = chunked(fisher[site][1][b])
        _check_finite(t, kv, seq)
        stored = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in t.items()}
        stored = stored if on_device else {k: v.cpu() for k, v in stored.items()}
        stored.update({f"qstat.{site}": v[b].float() for site, v in query_sums.items()})
        out.append(stored)
    return tuple(out)


class MemoryCapture:
    """Capture held in this process's memory: host RAM (``capture.store: memory``) or the accelerator's
    (``capture.store: device``); no files, nothing to reuse."""

    def __init__(self) -> None:
        self.sequences: dict[int, dict[str, torch.Tensor]] = {}
        self.meta: dict[str, Any] = {}
        self.copier: HostCopier | None = None  # holds the pinned host memory as long as the capture lives

    def release(self) -> threading.Thread:
        """Let go of the capture: its accelerator tensors now (their memory is free for the next stage at
        once), its host memory (unpinned and unmapped: seconds per hundred GB) in a background thread (returned)."""
        held = [self.sequences, self.copier]
        self.sequences, self.copier = {}, None
        for stored in held[0].values():
            for name in [n for n, t in stored.items() if t.device.type != "cpu"]:
                del stored[name]
        return let_go("capture: host memory", held)


def capture_kv(
    model: torch.nn.Module,
    calib: CalibrationSet,
    kv: KVLayout,
    *,
    cfg: CaptureConfig,
    out: Path | MemoryCapture,
    dist: DistContext = SINGLE,
    progress: Callable[[int], Any] | None = None,
    tasq_floor: float | None = None,
    device_sequences: int | None = None,
    query_stats: bool = True,
) -> list[int]:
    """Capture the sequences of this process (``dist.owns(i)``) into ``out``; returns their ids.

    For TaSQ methods (``tasq_floor`` = ``tasq.weight_floor``) a forward-only pass first gathers the query
    statistics of every sequence (all processes), so the keys' Fisher is stored reduced (see
    :func:`capture_sequence`). On disk, files are written under a temporary name and renamed, so a killed
    run leaves no partial shard, and sequences whose shard is already in ``out`` (an interrupted run's, kept by
    the run directory when the fingerprint matches) are not captured again. In memory, the first ``device_sequences``
    of this process's sequences stay on the accelerator (default: all for ``cfg.store`` device, none otherwise), the
    others go to host memory.
    ``query_stats=False``: no query statistics are gathered or stored (for methods without TaSQ).
    """
    mine = dist.mine(calib.input_ids.shape[0])
    todo = _missing_shards(out, mine, progress) if isinstance(out, Path) else mine
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    clock = DeviceClock(device)
    stats = weights = None
    if tasq_floor is not None:
        stats = query_statistics(model, calib.input_ids, kv, mine=mine, batch_size=cfg.batch_size, dist=dist)
        weights = key_weights(stats, kv, calib.input_ids.shape[1], floor=tasq_floor, device=device)
    keep = device_sequences if device_sequences is not None else (len(mine) if cfg.store == "device" else 0)
    to_host = isinstance(out, MemoryCapture) and device.type == "cuda" and keep < len(todo)
    # several processes drop the tensors only others need (share_sequences): one slab per tensor frees them
    copier = HostCopier(device, slab_per_tensor=dist.world > 1) if to_host else None
    if copier is not None:
        out.copier = copier
    copies = {}
    seconds = dict.fromkeys(("query_statistics", "forward_backward", "storing"), 0.0)
    seconds["query_statistics"] = clock.lap()
    with copier if copier is not None else contextlib.nullcontext():  # a failed copy stops the worker too
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            on_device = start + len(batch) <= keep
            results = capture_sequence(
                model,
                calib.input_ids[batch].to(device),
                kv,
                seqs=batch,
                dtype=TORCH_DTYPES[cfg.dtype],
                fisher_channels=cfg.channels_per_fisher,
                on_device=on_device or copier is not None,
                tasq_weights=weights,
                query_stats=query_stats,
            )
            seconds["forward_backward"] += clock.lap()
            for seq, stored in zip(batch, results):
                if stats is not None:
                    stored.update({f"qstat.{site}": t.clone() for site, t in stats[seq].items()})
                _store_sequence(out, seq, stored, copier=None if on_device else copier, copies=copies)
                if progress:
                    progress(1)
            seconds["storing"] += clock.lap()
        if copier is not None:
            out.sequences.update({seq: future.result() for seq, future in copies.items()})
    if copier is not None:
        seconds["storing"] += clock.lap()
    _log_seconds(seconds, copier)
    return mine


def _store_sequence(
    out: Path | MemoryCapture,
    seq: int,
    stored: dict[str, torch.Tensor],
    *,
    copier: HostCopier | None,
    copies: dict[int, Future],
) -> None:
    """Sequence ``seq``'s tensors to where they go: to host memory through ``copier`` (the future of the host
    dict kept in ``copies``), into the in-memory capture ``out``, or into their shard of the capture on disk."""
    if copier is not None:
        copies[seq] = copier.submit(stored, seq)  # to host memory behind the next sequences' capture
    elif isinstance(out, MemoryCapture):
        out.sequences[seq] = stored
    else:  # written (and hashed) from the tensors' own memory: no copy of them
        write_tensors_atomic(shard_path(out, seq), stored, {"sequence": str(seq)})


def _log_seconds(seconds: dict[str, float], copier: HostCopier | None) -> None:
    """The capture's time per part, and the host copier's worker's (with the slabs left pageable), logged."""
    log.info(
        "capture: %s",
        ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
        + (
            "; host copies (worker): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in copier.seconds.items())
            + (f"; {copier.pageable} slabs pageable (pinning failed)" if copier.pageable else "")
            if copier is not None
            else ""
        ),
    )


def shard_path(folder: Path, seq: int) -> Path:
    """The file of sequence ``seq`` in a capture on disk."""
    return folder / f"seq{seq:05d}.safetensors"


def _missing_shards(out: Path, mine: list[int], progress: Callable[[int], Any] | None) -> list[int]:
    """The sequences of ``mine`` with no shard in ``out`` yet (shards are renamed into place when whole; a killed
    run's unfinished ones of ``mine`` are removed, never another process's, which may be writing them now);
    those already there count as progress."""
    out.mkdir(parents=True, exist_ok=True)
    remove_temp_siblings(*(shard_path(out, i) for i in mine))
    todo = [i for i in mine if not shard_path(out, i).is_file()]
    if progress and len(todo) < len(mine):
        progress(len(mine) - len(todo))
    return todo


def capture_meta(
    calib: CalibrationSet,
    kv: KVLayout,
    cfg: CaptureConfig,
    *,
    memory: MemoryCapture | None = None,
    tasq_keys: bool = False,
) -> dict[str, Any]:
    """What a reader needs to know about a capture (``meta.json``); also set as ``memory.meta``.
    ``tasq_keys``: the keys' Fisher was stored as TaSQ-weighted RoPE-pair sums (``capture_kv(tasq_floor=...)``)."""
    meta = {
        "num_sequences": int(calib.input_ids.shape[0]),
        "sequence_length": int(calib.input_ids.shape[1]),
        "sink_tokens": calib.sink_tokens,
        "dtype": cfg.dtype,
        "kv_layout": kv.to_dict(),
        "qstat_pairs_per_sequence": pairs_per_sequence(calib.input_ids.shape[1]),
        "fisher_channels": cfg.channels_per_fisher,
        "fisher_key": "tasq_weighted_rope_pairs" if tasq_keys else "channels",
        "store": cfg.store if memory is not None else "disk",
    }
    if memory is not None:
        memory.meta = meta
    return meta


def write_meta(
    out_dir: Path,
    calib: CalibrationSet,
    kv: KVLayout,
    *,
    cfg: CaptureConfig,
    memory: MemoryCapture | None = None,
    tasq_keys: bool = False,
) -> dict[str, Any]:
    """Describe the capture in ``out_dir/meta.json`` (called once all sequences exist)."""
    meta = capture_meta(calib, kv, cfg, memory=memory, tasq_keys=tasq_keys)
    if memory is not None:
        have = set(memory.sequences)
    else:
        have = {i for i in range(meta["num_sequences"]) if shard_path(out_dir, i).is_file()}
    missing = [i for i in range(meta["num_sequences"]) if i not in have]
    if missing:
        raise CaptureError(f"capture incomplete: sequences {missing} have no file in {out_dir}")
    write_bytes_atomic(out_dir / "meta.json", json.dumps(meta, indent=1).encode())
    return meta


def share_sequences(capture: MemoryCapture, needs: list[list[str]], dist: DistContext, *, num_sequences: int) -> None:
    """An in-memory capture across processes: after each process captured the sequences ``i % world ==
    rank``, process r receives the tensors ``needs[r]`` of every sequence it did not capture, by
    point-to-point transfers (NCCL between GPUs, host tensors staged through this process's GPU; gloo on
    CPU). Each process drops the tensors of its sequences named for other processes only as soon as they
    are sent, with their host memory (the copier's slabs that no kept tensor lives in), so it never holds
    more than its own sequences and what it received so far."""
    rank, world = dist.rank, dist.world
    if not capture.sequences:
        raise CaptureError(
            f"process {rank} captured no sequence: data.num_sequences {num_sequences} is below the {world} processes"
        )
    own = next(iter(capture.sequences.values()))  # every captured sequence holds every tensor
    others = {n for r in range(world) if r != rank for n in needs[r]} - set(needs[rank])
    via = dist.transfer_device()
    for seq in range(num_sequences):
        owner = seq % world
        ops, received = [], []
        if owner == rank:
            stored = capture.sequences[seq]
            ops = [
                torch_dist.P2POp(torch_dist.isend, stored[n].to(via).contiguous(), r)
                for r in range(world)
                if r != rank
                for n in needs[r]
            ]
        else:
            received = [(n, torch.empty_like(own[n], device=via)) for n in needs[rank]]
            ops = [torch_dist.P2POp(torch_dist.irecv, t, owner) for _, t in received]
        for req in torch_dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        if received:
            capture.sequences[seq] = {n: t.to(own[n].device) for n, t in received}
        elif owner == rank:  # sent: the tensors only others need go now
            for n in others & stored.keys():
                del stored[n]
            if capture.copier is not None:  # unpin the slabs those tensors were the last to use: their memory goes
                capture.copier.drop_unused(seq, stored)
