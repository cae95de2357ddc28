"""Where a capture goes: ``capture.store: auto`` picks the accelerator's memory, host memory or disk from
the capture's size and what is free, before any work starts (docs/config.md, "capture").

The size is exact (every stored tensor's bytes). The accelerator keeps room for the model's weights, the
capture step's own working memory (:func:`capture_step_bytes`) and 5 % of the card (allocator
fragmentation), and where sequences go to host memory from it, the ``COPY_DEPTH`` sequences waiting there
for their copy (:class:`~loopvq_calib.runtime.host_memory.HostCopier`); host memory keeps a tenth of the
machine's memory; the disk keeps 5 % free.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config.schema import CaptureConfig
from ...config.source import ConfigError
from ...models.loading import TORCH_DTYPES
from ...models.sites import KVLayout
from ...runtime.host_memory import COPY_DEPTH, host_available

GB = 1e9


def capture_bytes(
    kv: KVLayout, num_sequences: int, sequence_length: int, *, cfg: CaptureConfig, tasq_keys: bool = False
) -> int:
    """Bytes of a whole capture: per sequence and site, keys and values [S, H, D] and their Fisher
    [S, H, D / fisher_channels] (TaSQ keys: [S, H, D / 2]) in ``capture.dtype``, the fp32 query statistic
    [H, D]; int64 token ids."""
    hd = kv.kv_heads * kv.head_dim
    fisher = 1 / cfg.channels_per_fisher + (1 / 2 if tasq_keys else 1 / cfg.channels_per_fisher)
    per_site = sequence_length * hd * TORCH_DTYPES[cfg.dtype].itemsize * (2 + fisher) + hd * 4
    return int(num_sequences * (kv.num_sites * per_site + sequence_length * 8))


def capture_step_bytes(kv: KVLayout, hidden_size: int, sequence_length: int, *, batch_size: int) -> int:
    """Accelerator memory one capture step needs besides the weights and the stored capture: its forward's
    activations kept for the backward, the recorded keys and values and their probes' gradients: 64 bytes
    per site, token and hidden unit (with room above the need measured at Ouro's and Huginn's shapes, where the
    Fisher's float32 temporaries come on top)."""
    return 64 * kv.num_sites * sequence_length * hidden_size * batch_size


def disk_available(folder: Path) -> int:
    """Free bytes on the file system that will hold ``folder`` (its nearest existing parent), less 5 %."""
    path = Path(folder).resolve()
    while not path.exists():
        path = path.parent
    usage = shutil.disk_usage(path)
    return usage.free - usage.total // 20


@dataclass
class StoreChoice:
    """A resolved ``capture.store``."""

    store: str  # device | memory | disk | split (the first device_sequences on the accelerator, the rest on the host)
    reason: str  # the numbers behind the choice, for the log and the stage record
    device_sequences: int = 0  # sequences (of this process) kept on the accelerator


def choose_store(
    cfg: CaptureConfig,
    kv: KVLayout,
    num_sequences: int,
    *,
    sequence_length: int,
    device: torch.device,
    model_bytes: int,
    step_bytes: int,
    capture_dir: Path,
    processes: int = 1,
    tasq_keys: bool = False,
) -> StoreChoice:
    """Resolve ``capture.store``. ``auto``: the first of device, memory, disk that holds the capture, or
    (one process) ``split``: as many sequences on the accelerator as it holds, the rest in host memory. On
    an accelerator, host memory (``memory``, ``split``'s host part) also needs accelerator room for the
    :class:`HostCopier`'s ``COPY_DEPTH`` sequences in flight. A store that cannot hold it (auto: none)
    raises :class:`ConfigError` with the numbers. ``step_bytes``: the capture step's own accelerator memory
    (:func:`capture_step_bytes`)."""
    total = capture_bytes(kv, num_sequences, sequence_length, cfg=cfg, tasq_keys=tasq_keys)
    per_sequence = capture_bytes(kv, 1, sequence_length, cfg=cfg, tasq_keys=tasq_keys)
    share = total // processes  # in-memory stores: each process keeps its layouts of every sequence
    need = (
        f"the capture takes {total / GB:.2f} GB ({num_sequences} sequences x {sequence_length} tokens x "
        f"{kv.num_sites} sites, fisher_channels {cfg.channels_per_fisher})"
    )
    room: dict[str, tuple[int, int, str]] = {}  # store -> (bytes needed, bytes available, where)
    if device.type == "cuda":
        free, card = torch.cuda.mem_get_info(device)
        room["device"] = (
            share,
            free - model_bytes - step_bytes - card // 20,
            f"{device}: {free / GB:.1f} GB free, less the weights {model_bytes / GB:.1f} GB, "
            f"{step_bytes / GB:.1f} GB for the capture step and 5 % of the card, per process",
        )
    room["memory"] = (total, host_available(), "host memory available, less a tenth of the machine's")
    room["disk"] = (total, disk_available(capture_dir), f"free on the disk of {capture_dir}, less 5 %")
    fits = {s: n <= avail for s, (n, avail, _) in room.items()}
    summary = "; ".join(f"{s}: {max(avail, 0) / GB:.2f} GB ({where})" for s, (_, avail, where) in room.items())
    mine = -(-num_sequences // processes)
    in_flight = 0  # accelerator memory of the sequences the HostCopier holds until they are in host memory
    if device.type == "cuda":
        in_flight = min(COPY_DEPTH, mine) * per_sequence
        fits["memory"] = fits["memory"] and room["device"][1] >= in_flight
        summary += (
            f"; copies to host memory keep up to {min(COPY_DEPTH, mine)} sequences ({in_flight / GB:.2f} GB)"
            f" on {device} while in flight"
        )
    if cfg.store == "auto":
        for store in ("device", "memory", "disk"):
            if fits.get(store):
                return StoreChoice(
                    store, f"capture.store auto -> {store}: {need}; {summary}", mine if store == "device" else 0
                )
        on_device = max(room.get("device", (0, 0, ""))[1] - in_flight, 0) // per_sequence
        if processes == 1 and on_device and (num_sequences - on_device) * per_sequence <= room["memory"][1]:
            return StoreChoice(
                "split",
                f"capture.store auto -> split: {on_device} sequences on {device}, "
                f"{num_sequences - on_device} in host memory (with room on {device} for "
                f"the sequences in flight to it): {need}; {summary}",
                on_device,
            )
        raise ConfigError(
            "capture.store",
            f"no store holds the capture: {need}; {summary}. Lower data.num_sequences "
            f"or data.sequence_length, or free memory or disk",
        )
    if cfg.store in ("memory", "disk") and not fits[cfg.store]:
        raise ConfigError("capture.store", f"{cfg.store} cannot hold the capture: {need}; {summary}")
    note = "" if fits.get(cfg.store, True) else " (the estimate says it does not fit)"
    return StoreChoice(
        cfg.store,
        f"capture.store {cfg.store} as configured{note}: {need}; {summary}",
        mine if cfg.store == "device" else 0,
    )
