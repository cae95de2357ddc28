"""The checks of a calibration run, all before anything is written: :func:`plan_run` resolves and validates the
config against the model's config.json, the stages asked for, the devices, the k-means backend, the capture's
store, the output folder and (unless the run directory holds a reusable data stage) the calibration data itself,
built once by the main process. It returns a :class:`RunPlan`, from which the pipeline wires its stages."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ..codes.layouts import plan_layouts
from ..config.load import resolve_derived
from ..config.schema import Config
from ..config.source import ConfigError
from ..config.validate import validate, validate_for_model
from ..data.corpus import CalibrationSet, build_calibration_set
from ..kernels.prepare import prepare_codec_kernels
from ..models.loading import (
    TORCH_DTYPES,
    ModelIdentity,
    check_model_folder,
    check_weights_match,
    load_tokenizer,
    model_identity,
    model_skeleton,
    model_window,
    pick_device,
    resolve_model_dir,
    set_loop_steps,
)
from ..models.limits import check_loop_sites, looped_layers
from ..models.sites import KVLayout
from ..runtime.processes import DistContext, start_processes
from ..runtime.warmup import Warmup, warm_linalg
from .capture.store import StoreChoice, capture_step_bytes, choose_store
from .fingerprints import data_fingerprint, stage_fingerprints
from .kmeans.fit import run_points_per_codebook
from .kmeans.select import resolve_backend
from .rundir import RunDir

STAGES = ("data", "capture", "tasq", "kmeans", "finetune", "bundle")
GPU_WINDOW = 1024  # windows this long (the shipped configs of real models use 2,048) are meant for a GPU


@dataclass(frozen=True)
class RunPlan:
    """A checked run: what the stages need to know before the first one starts."""

    cfg: Config  # resolved and validated (a copy: the caller's config is left as it was)
    dist: DistContext  # this process among the run's processes
    wanted: tuple[str, ...]  # the stages to run or reuse, in order
    model_folder: Path  # the model's files (a local folder or its hub cache snapshot)
    kv: KVLayout  # the model's KV sites at the run's loop count
    identity: ModelIdentity  # what the bundle records of the model
    device: torch.device  # the model's
    kmeans_device: torch.device  # TaSQ's and k-means'
    run: RunDir  # the run directory, checked (not opened: nothing is written yet)
    store: StoreChoice | None  # where the capture goes (None: no capture stage is wanted)
    fingerprints: dict[str, str | None]  # stage -> fingerprint (tasq: None for methods without it)
    calibration: CalibrationSet | None  # built by the main process, unless the data stage is reused
    tokenizer: Any  # the tokenizer the calibration set was built with (None when none was built)
    timings: dict[str, float]  # seconds of each check, for the manifest's ``startup``


def plan_run(cfg: Config, output: str | Path | None = None, stages: list[str] | None = None, *,
             dist: DistContext | None = None, warmup: Warmup) -> RunPlan:
    """Check a run (module docstring) and return its plan; raises on bad input (ConfigError, ModelLoadError,
    DataError, RunDirError, ValueError for ``stages``). ``output``: the run directory (default
    ``output.dir``); ``stages``: as ``--stages``; ``dist``: the run's processes (default: started here, joining
    the process group under ``accelerate launch``); ``warmup``: gets the background jobs of the checks (TaSQ's
    first linear algebra, the k-means kernels' probe of ``kmeans.backend: auto`` on CUDA)."""
    timings: dict[str, float] = {}
    cfg = validate(resolve_derived(copy.deepcopy(cfg)))  # a Config built in code gets its derived values and checks
    with timed(timings, "processes_s"):  # CUDA and, under accelerate launch, the process group
        dist = dist or start_processes(cfg.model.device)
    wanted = wanted_stages(cfg, stages)
    with timed(timings, "model_shape_s"):  # the folder's files and the model built on the meta device
        folder = resolve_model_dir(cfg.model.name_or_path, cfg.model.revision)
        model_config = check_model_folder(folder)
        check_sequence_length(cfg, model_config, folder)
        kv, model_bytes = model_shape(model_config, cfg.model.loop_steps, cfg.model.dtype, folder=folder)
    validate_for_model(cfg, kv.head_dim, kv.kv_heads, loop_steps=kv.loop_steps,
                       has_prelude=any(not s.looped for s in kv.sites))
    with timed(timings, "model_identity_s"):
        identity = model_identity(folder, recorded_model_name(cfg.model.name_or_path), cfg.model.revision)
    device = pick_device(cfg.model.device) if cfg.model.device != "auto" else dist.device
    kmeans_device = pick_device(cfg.kmeans.device, "kmeans.device") if cfg.kmeans.device != "auto" else device
    if "tasq" in wanted and cfg.quant.uses_tasq and kmeans_device.type == "cuda":  # jobs in stage order
        warmup.submit("linalg", kmeans_device, warm_linalg, kmeans_device)
    with timed(timings, "kmeans_backend_s"):
        if "kmeans" in wanted:
            check_kmeans_backend(cfg, kv, kmeans_device, warmup=warmup)
    if "finetune" in wanted and device.type == "cuda":  # the kernels fine-tuning's first encode and decode launch
        warmup.submit("codec_kernels", device, prepare_codec_kernels, device, k=cfg.quant.codebook_size,
                      g=cfg.quant.group_size)
    run = RunDir(Path(output or cfg.output.dir), dist.is_main, dist.barrier, stage_names=STAGES)
    store = None
    if "capture" in wanted:
        step = capture_step_bytes(kv, model_config.hidden_size, cfg.data.sequence_length,
                                  batch_size=cfg.capture.batch_size)
        store = choose_store(cfg.capture, kv, cfg.data.num_sequences, sequence_length=cfg.data.sequence_length,
                             device=device, model_bytes=model_bytes, step_bytes=step, capture_dir=run.root,
                             processes=dist.world, tasq_keys=cfg.quant.uses_tasq)
    with timed(timings, "data_fingerprint_s"):
        data_fp = data_fingerprint(cfg, folder)
    fingerprints = stage_fingerprints(cfg, data_fp, identity.to_dict(), loop_steps=kv.loop_steps)
    building = dist.is_main and not run.reusable("data", data_fp)
    with timed(timings, "calibration_set_s"):  # tokenizer, text, tokens: checked before any work
        tokenizer = load_tokenizer(folder) if building else None
        calibration = build_calibration_set(cfg.data, tokenizer) if building else None
    return RunPlan(cfg, dist, tuple(wanted), folder, kv, identity, device, kmeans_device, run, store, fingerprints,
                   calibration, tokenizer, timings)


def wanted_stages(cfg: Config, stages: list[str] | None) -> list[str]:
    """The stages to run or reuse: all, or up to the last one of ``stages`` (``--stages``)."""
    wanted = [s for s in STAGES if s != "tasq" or cfg.quant.uses_tasq]
    if not stages:
        return wanted
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {', '.join(map(repr, unknown))}; stages are {', '.join(STAGES)}")
    if "tasq" in stages and not cfg.quant.uses_tasq:
        raise ValueError(f"--stages: the tasq stage exists only for quant.method tasq or tasq+loopvq, "
                         f"not {cfg.quant.method}")
    return wanted[: max(wanted.index(s) for s in stages if s in wanted) + 1]


def check_sequence_length(cfg: Config, model_config: Any, folder: Path) -> None:
    """``data.sequence_length`` fits the model's window (:func:`~loopvq_calib.models.loading.model_window`)."""
    window, field = model_window(model_config)
    if cfg.data.sequence_length > window:
        raise ConfigError("data.sequence_length", f"{cfg.data.sequence_length:,} tokens exceed the model's window of "
                                                  f"{window:,} tokens ({field} in {folder / 'config.json'})")


def model_shape(model_config: Any, loop_steps: int | None, dtype: str, *, folder: Path | None = None
                ) -> tuple[KVLayout, int]:
    """The KV sites and the weights' bytes in ``dtype`` of a model built on the meta device (no weights read);
    a config.json that builds no model, or whose model the weights in ``folder`` are not (names or shapes), or a
    loop count giving more KV sites than the toolkit takes, is a ModelLoadError."""
    model = model_skeleton(model_config)
    if folder is not None:
        check_weights_match(model, folder)
    if loop_steps is not None:
        check_loop_sites(looped_layers(model_config), loop_steps, key="model.loop_steps")
    set_loop_steps(model, loop_steps)
    return model.kv_layout(), sum(p.numel() for p in model.parameters()) * TORCH_DTYPES[dtype].itemsize


def gpu_sized(cfg: Config, device: torch.device) -> str | None:
    """The warning for a config sized for a GPU (windows of GPU_WINDOW tokens or more) run on the CPU, else None."""
    if device.type != "cpu" or cfg.data.sequence_length < GPU_WINDOW:
        return None
    return (f"this config's {cfg.data.sequence_length:,}-token windows (data.sequence_length) are sized for a GPU and "
            "this run is on the CPU: expect a long run (the progress bars estimate it); for a first try on the CPU "
            "use configs/tiny-ouro.yaml, or --set data.sequence_length=256")


def recorded_model_name(name_or_path: str) -> str:
    """How the bundle names the model: a local folder by its absolute path, a hub id as given."""
    path = Path(name_or_path).expanduser()
    return os.path.abspath(path) if path.is_dir() else name_or_path


def check_kmeans_backend(cfg: Config, kv: KVLayout, device: torch.device, *, warmup: Warmup) -> None:
    """An unusable ``kmeans.backend`` fails here, before any work. ``auto`` on CUDA probes instead, on ``warmup``:
    the probe compiles the kernels for the run's problems (kept for the stage) and a failed probe falls back."""
    points = run_points_per_codebook(plan_layouts(kv, cfg.quant), cfg.data.num_sequences, cfg.data.sequence_length,
                                     sink_tokens=cfg.data.sink_tokens, sharing=cfg.quant.codebook_sharing)
    backend = (cfg.kmeans.backend, device, (cfg.quant.codebook_size, cfg.quant.group_size))
    if cfg.kmeans.backend == "auto" and device.type == "cuda":
        warmup.submit("kmeans_backend", device, resolve_backend, *backend, points=points)
    else:
        resolve_backend(*backend, points=points)


@contextmanager
def timed(into: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block takes as ``into[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        into[key] = round(time.perf_counter() - start, 3)
