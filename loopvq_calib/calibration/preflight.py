"""The checks of a calibration run, all before anything is written: :func:`plan_run` resolves and validates the
config, the stages asked for (against the stage table), the model (:func:`describe_model`: its files and its
shape against the config, once), the devices, the k-means backend, the capture's store, the output folder and
(unless the run directory holds a reusable data stage) the calibration data itself, built once by the main
process. It returns a :class:`~loopvq_calib.calibration.plan.RunPlan`, which the pipeline hands to the stages."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..codes.layouts import plan_layouts
from ..config.load import resolve_derived
from ..config.schema import Config
from ..config.source import ConfigError
from ..config.validate import validate, validate_for_model
from ..data.corpus import build_calibration_set
from ..kernels.prepare import prepare_codec_kernels
from ..models.limits import check_loop_sites, looped_layers
from ..models.loading import (
    TORCH_DTYPES,
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
from ..models.sites import KVLayout
from ..runtime.processes import DistContext, start_processes
from ..runtime.warmup import Warmup, warm_linalg
from .capture.store import StoreChoice, capture_step_bytes, choose_store
from .fingerprints import run_facts, stage_fingerprints
from .kmeans.fit import run_points_per_codebook
from .kmeans.select import resolve_backend
from .plan import ModelFacts, RunPlan
from .rundir import RunDir
from .stage_table import STAGES, Stage

GPU_WINDOW = 1024  # windows this long (the shipped configs of real models use 2,048) are meant for a GPU


def plan_run(
    cfg: Config,
    output: str | Path | None = None,
    stages: list[str] | None = None,
    *,
    dist: DistContext | None = None,
    warmup: Warmup,
    table: Sequence[Stage] = STAGES,
) -> RunPlan:
    """Check a run (module docstring) and return its plan; raises on bad input (ConfigError, ModelLoadError,
    DataError, RunDirError, ValueError for ``stages``). ``output``: the run directory (default
    ``output.dir``); ``stages``: as ``--stages``; ``dist``: the run's processes (default: started here, joining
    the process group under ``accelerate launch``); ``warmup``: gets the background jobs of the checks (TaSQ's
    first linear algebra, the k-means kernels' probe of ``kmeans.backend: auto`` on CUDA); ``table``: the
    stages."""
    timings: dict[str, float] = {}
    cfg = validate(resolve_derived(copy.deepcopy(cfg)))  # a Config built in code gets its derived values and checks
    with timed(timings, "processes_s"):  # CUDA and, under accelerate launch, the process group
        dist = dist or start_processes(cfg.model.device)
    wanted = wanted_stages(cfg, stages, table)
    model = describe_model(cfg, timings)
    device = pick_device(cfg.model.device) if cfg.model.device != "auto" else dist.device
    kmeans_device = pick_device(cfg.kmeans.device, "kmeans.device") if cfg.kmeans.device != "auto" else device
    prepare_stages(cfg, wanted, (device, kmeans_device), kv=model.kv, warmup=warmup, timings=timings)
    run = RunDir(Path(output or cfg.output.dir), dist.is_main, dist.barrier, stage_names=tuple(s.name for s in table))
    store = choose_capture_store(cfg, model, device, run=run, dist=dist) if "capture" in wanted else None
    with timed(timings, "data_fingerprint_s"):  # the tokenizer's and the data's files
        fingerprints = stage_fingerprints(cfg, run_facts(cfg, model), table)
    building = dist.is_main and not run.reusable("data", fingerprints["data"])
    with timed(timings, "calibration_set_s"):  # tokenizer, text, tokens: checked before any work
        tokenizer = load_tokenizer(model.folder) if building else None
        calibration = build_calibration_set(cfg.data, tokenizer) if building else None
    return RunPlan(
        cfg=cfg,
        dist=dist,
        wanted=tuple(wanted),
        model=model,
        device=device,
        kmeans_device=kmeans_device,
        run=run,
        store=store,
        fingerprints=fingerprints,
        calibration=calibration,
        tokenizer=tokenizer,
        timings=timings,
    )


def wanted_stages(cfg: Config, stages: list[str] | None, table: Sequence[Stage] = STAGES) -> list[str]:
    """The stages of ``table`` to run or reuse: all that ``cfg`` has, or those up to the last one of ``stages``
    (``--stages``)."""
    existing = [s.name for s in table if s.applies(cfg)]
    if not stages:
        return existing
    names = [s.name for s in table]
    unknown = sorted(set(stages) - set(names))
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {', '.join(map(repr, unknown))}; stages are {', '.join(names)}")
    for stage in table:
        if stage.name in stages and not stage.applies(cfg):
            raise ValueError(f"--stages: the {stage.name} stage exists only for {stage.exists.only_for(cfg)}")
    return existing[: max(existing.index(s) for s in stages) + 1]


def describe_model(cfg: Config, timings: dict[str, float]) -> ModelFacts:
    """The model ``cfg`` names, checked without loading its weights (its folder's files, its window against
    ``data.sequence_length``, its shape, the config against its KV heads and loop count) and described once for
    the whole run; ``timings`` gets ``model_shape_s`` and ``model_identity_s``."""
    with timed(timings, "model_shape_s"):  # the folder's files and the model built on the meta device
        folder = resolve_model_dir(cfg.model.name_or_path, cfg.model.revision)
        model_config = check_model_folder(folder)
        check_sequence_length(cfg, model_config, folder)
        kv, weight_bytes = model_shape(model_config, cfg.model.loop_steps, cfg.model.dtype, folder=folder)
    validate_for_model(
        cfg, kv.head_dim, kv.kv_heads, loop_steps=kv.loop_steps, has_prelude=any(not s.looped for s in kv.sites)
    )
    with timed(timings, "model_identity_s"):
        identity = model_identity(folder, recorded_model_name(cfg.model.name_or_path), cfg.model.revision)
    return ModelFacts(folder=folder, config=model_config, kv=kv, weight_bytes=weight_bytes, identity=identity)


def prepare_stages(
    cfg: Config,
    wanted: list[str],
    devices: tuple[torch.device, torch.device],
    *,
    kv: KVLayout,
    warmup: Warmup,
    timings: dict[str, float],
) -> None:
    """The wanted stages' background jobs, submitted in stage order (TaSQ's first linear algebra on CUDA, the kernels
    of fine-tuning's first encode and decode on CUDA), and the k-means backend's check (``kmeans_backend_s``);
    ``devices``: the model's and k-means'."""
    device, kmeans_device = devices
    if "tasq" in wanted and kmeans_device.type == "cuda":
        warmup.submit("linalg", kmeans_device, warm_linalg, kmeans_device)
    with timed(timings, "kmeans_backend_s"):
        if "kmeans" in wanted:
            check_kmeans_backend(cfg, kv, kmeans_device, warmup=warmup)
    if "finetune" in wanted and device.type == "cuda":
        warmup.submit(
            "codec_kernels", device, prepare_codec_kernels, device, k=cfg.quant.codebook_size, g=cfg.quant.group_size
        )


def choose_capture_store(
    cfg: Config, model: ModelFacts, device: torch.device, *, run: RunDir, dist: DistContext
) -> StoreChoice:
    """Where the capture goes (:func:`~loopvq_calib.calibration.capture.store.choose_store`)."""
    step = capture_step_bytes(
        model.kv, model.config.hidden_size, cfg.data.sequence_length, batch_size=cfg.capture.batch_size
    )
    return choose_store(
        cfg.capture,
        model.kv,
        cfg.data.num_sequences,
        sequence_length=cfg.data.sequence_length,
        device=device,
        model_bytes=model.weight_bytes,
        step_bytes=step,
        capture_dir=run.root,
        processes=dist.world,
        tasq_keys=cfg.quant.uses_tasq,
    )


def check_sequence_length(cfg: Config, model_config: Any, folder: Path) -> None:
    """``data.sequence_length`` fits the model's window (:func:`~loopvq_calib.models.loading.model_window`)."""
    window, field = model_window(model_config)
    if cfg.data.sequence_length > window:
        raise ConfigError(
            "data.sequence_length",
            f"{cfg.data.sequence_length:,} tokens exceed the model's window of "
            f"{window:,} tokens ({field} in {folder / 'config.json'})",
        )


def model_shape(
    model_config: Any, loop_steps: int | None, dtype: str, *, folder: Path | None = None
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
    return (
        f"this config's {cfg.data.sequence_length:,}-token windows (data.sequence_length) are sized for a GPU and "
        "this run is on the CPU: expect a long run (the progress bars estimate it); for a first try on the CPU "
        "use configs/tiny-ouro.yaml, or --set data.sequence_length=256"
    )


def recorded_model_name(name_or_path: str) -> str:
    """How the bundle names the model: a local folder by its absolute path, a hub id as given."""
    path = Path(name_or_path).expanduser()
    return os.path.abspath(path) if path.is_dir() else name_or_path


def check_kmeans_backend(cfg: Config, kv: KVLayout, device: torch.device, *, warmup: Warmup) -> None:
    """An unusable ``kmeans.backend`` fails here, before any work. ``auto`` on CUDA probes instead, on ``warmup``:
    the probe compiles the kernels for the run's problems (kept for the stage) and a failed probe falls back."""
    points = run_points_per_codebook(
        plan_layouts(kv, cfg.quant),
        cfg.data.num_sequences,
        cfg.data.sequence_length,
        sink_tokens=cfg.data.sink_tokens,
        sharing=cfg.quant.codebook_sharing,
    )
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
