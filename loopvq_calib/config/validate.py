"""Checks of the config tree (:mod:`loopvq_calib.config.schema`): every value and combination, pure (a config is
never changed here); :func:`validate_for_model` adds the checks that need the model's shapes. Each failure
raises :class:`ConfigError` naming the key path and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from .methods import TASQ_GROUPINGS, method_names
from .schema import (
    AUTOCAST_MODES,
    CACHE_TEACHER,
    CAPTURE_STORES,
    DATA_TYPES,
    DTYPE_NAMES,
    KMEANS_BACKENDS,
    KMEANS_INITS,
    LR_SCHEDULES,
    PARAMETERIZATIONS,
    SHARING,
    TEXT_SAMPLE_BY,
    CaptureConfig,
    Config,
    DataConfig,
    FinetuneConfig,
    KMeansConfig,
    ModelConfig,
    OutputConfig,
    QuantConfig,
    TasqConfig,
)
from .source import ConfigError, shown

SEED_LIMIT = 2**32  # seeds any generator accepts (numpy needs < 2**32)
INT_LIMIT = 2**31 - 1
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:[0-9]+)?")  # the devices a config or --device may name
MAX_LOOP_STEPS = 1024  # loop steps a run or a bundle may have (released looped models use 4 to 64)


def exact_fisher_channels(quant: QuantConfig) -> int:
    """The largest ``capture.fisher_channels`` that keeps every code group's Fisher weight exact: the
    channels per step of a group (G / T_c), whose chunks every plain group covers whole. (TaSQ methods store
    their keys' Fisher per RoPE pair whatever this is; it applies to their values.)"""
    return quant.group_size // quant.block_steps


def validate_capture(c: CaptureConfig, q: QuantConfig) -> None:
    """Check ``capture.*`` against ``quant.*`` (``fisher_channels: null`` stands for the exact value)."""
    _choice("capture.dtype", c.dtype, DTYPE_NAMES)
    _positive("capture.batch_size", c.batch_size)
    _choice("capture.store", c.store, CAPTURE_STORES)
    fc = exact_fisher_channels(q) if c.fisher_channels is None else c.fisher_channels
    _positive("capture.fisher_channels", fc)
    if (q.group_size // q.block_steps) % fc:
        raise ConfigError(
            "capture.fisher_channels",
            f"{fc} does not divide the {q.group_size // q.block_steps} channels per step of a code group",
        )


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(path, f"{shown(value)} is not allowed; choose one of {', '.join(allowed)}")


def _positive(path: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(path, f"must be {'>= 0' if zero_ok else '> 0'}, got {shown(value)}")


def _seed(path: str, value: int) -> None:
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(path, f"must be in [0, 2**32), got {shown(value)}")


def _numbers(obj: Any, path: str = "") -> None:
    """Every float finite, every int but the seeds (see _seed) at most INT_LIMIT in magnitude (a typo like
    99999999999 fails here, not hours in)."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            _numbers(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {shown(value)}")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT and f.name != "seed":
            raise ConfigError(key, f"{shown(value)} is out of range (at most {INT_LIMIT:,})")


def _validate_model(m: ModelConfig) -> None:
    _choice("model.dtype", m.dtype, DTYPE_NAMES)
    _device("model.device", m.device)
    if m.loop_steps is not None:
        _positive("model.loop_steps", m.loop_steps)
        if m.loop_steps > MAX_LOOP_STEPS:
            raise ConfigError(
                "model.loop_steps",
                f"{m.loop_steps:,} is more loop steps than this toolkit takes (at most {MAX_LOOP_STEPS:,})",
            )
    if not m.name_or_path.strip():
        raise ConfigError("model.name_or_path", "must not be empty")


def _device(key: str, device: str) -> None:
    if not DEVICE_NAME.fullmatch(device):
        raise ConfigError(key, f"{shown(device)} is not allowed; use auto, cpu, cuda or cuda:N")


def _validate_data(d: DataConfig, finetune_enabled: bool) -> None:
    if not d.dataset.strip():
        raise ConfigError("data.dataset", "must not be empty")
    _choice("data.type", d.type, DATA_TYPES)
    _choice("data.text_sample_by", d.text_sample_by, TEXT_SAMPLE_BY)
    _positive("data.num_sequences", d.num_sequences)
    _positive("data.sequence_length", d.sequence_length)
    _positive("data.sink_tokens", d.sink_tokens, zero_ok=True)
    _positive("data.heldout_sequences", d.heldout_sequences, zero_ok=True)
    _seed("data.seed", d.seed)
    if d.chat_template and d.type == "text":
        raise ConfigError(
            "data.chat_template",
            "needs rows of messages (json, jsonl, parquet or a hub dataset), not plain text files (data.type text)",
        )
    if d.sink_tokens >= d.sequence_length:
        raise ConfigError(
            "data.sink_tokens",
            f"{d.sink_tokens} sinks leave no token of a {d.sequence_length}-token sequence to quantize",
        )
    if finetune_enabled and not 0 < d.heldout_sequences < d.num_sequences:
        raise ConfigError(
            "data.heldout_sequences",
            f"fine-tuning needs 0 < heldout_sequences < num_sequences ({d.num_sequences}), got {d.heldout_sequences}",
        )


def _validate_quant(q: QuantConfig) -> None:
    _choice("quant.method", q.method, method_names())
    _choice("quant.codebook_sharing", q.codebook_sharing, SHARING)
    if q.codebook_size < 2 or q.codebook_size & (q.codebook_size - 1) or q.codebook_size > 65536:
        raise ConfigError("quant.codebook_size", f"must be a power of two in [2, 65536], got {q.codebook_size}")
    _positive("quant.group_size", q.group_size)
    _positive("quant.steps_per_block", q.steps_per_block)
    derived = derived_bits(q)
    if q.bits is not None and not math.isclose(q.bits, derived, rel_tol=1e-9):
        raise ConfigError(
            "quant.bits",
            f"{q.bits} does not match log2(codebook_size)/group_size = log2({q.codebook_size})/{q.group_size} = "
            f"{derived:g}",
        )
    if q.loop_axis and q.group_size % q.steps_per_block:
        raise ConfigError(
            "quant.group_size",
            f"group_size {q.group_size} is not divisible by steps_per_block {q.steps_per_block} "
            "(each code covers c = G / T_c channels in each step of a block)",
        )
    if q.uses_tasq and (q.group_size // q.block_steps) % 2:
        raise ConfigError(
            "quant.group_size",
            f"TaSQ keeps each RoPE pair in one group: channels per step G/T_c = {q.group_size // q.block_steps} "
            "must be even",
        )


def _validate_kmeans(k: KMeansConfig) -> None:
    _choice("kmeans.backend", k.backend, KMEANS_BACKENDS)
    _choice("kmeans.init", k.init, KMEANS_INITS)
    _device("kmeans.device", k.device)
    _positive("kmeans.iterations", k.iterations)
    _positive("kmeans.tolerance", k.tolerance, zero_ok=True)
    _seed("kmeans.seed", k.seed)
    for name in ("problems_per_batch", "points_per_chunk"):
        if getattr(k, name) is not None:
            _positive(f"kmeans.{name}", getattr(k, name))


def _validate_tasq(t: TasqConfig, q: QuantConfig) -> None:
    _choice("tasq.grouping", t.grouping, TASQ_GROUPINGS)
    if q.uses_tasq:
        _choice("tasq.grouping", t.grouping, q.declaration.tasq_groupings)
    for name in ("det_eps", "sigma_min", "weight_floor"):
        _positive(f"tasq.{name}", getattr(t, name))
    if t.weight_floor >= 1:
        raise ConfigError(
            "tasq.weight_floor", f"is a fraction of the largest weight and must be < 1, got {t.weight_floor}"
        )


def validate_finetune(f: FinetuneConfig) -> None:
    """The ``finetune`` section's own values."""
    _positive("finetune.epochs", f.epochs, zero_ok=True)
    _positive("finetune.lr", f.lr)
    _choice("finetune.lr_schedule", f.lr_schedule, LR_SCHEDULES)
    _positive("finetune.warmup_steps", f.warmup_steps, zero_ok=True)
    _positive("finetune.batch_size", f.batch_size)
    _positive("finetune.select_every", f.select_every, zero_ok=True)
    _positive("finetune.selection_batch", f.selection_batch)
    _choice("finetune.parameterization", f.parameterization, PARAMETERIZATIONS)
    _positive("finetune.min_usage", f.min_usage, zero_ok=True)
    if f.min_usage and f.parameterization != "codewords":
        raise ConfigError(
            "finetune.min_usage",
            f"{f.min_usage} restricts codewords; it needs parameterization codewords, not {f.parameterization}",
        )
    _positive("finetune.proximal", f.proximal, zero_ok=True)
    _positive("finetune.kl_chunk", f.kl_chunk)
    _seed("finetune.seed", f.seed)
    _choice("finetune.autocast", f.autocast, AUTOCAST_MODES)
    _choice("finetune.cache_teacher", f.cache_teacher, CACHE_TEACHER)
    if f.loop_checkpointing not in (True, False, "auto") or type(f.loop_checkpointing) not in (bool, str):
        raise ConfigError(
            "finetune.loop_checkpointing",
            f"{shown(f.loop_checkpointing)} is not allowed; choose one of true, false, auto",
        )


def _validate_output(o: OutputConfig, d: DataConfig) -> None:
    if not o.dir.strip():
        raise ConfigError("output.dir", "must not be empty")
    if o.bundle_name is not None and (not o.bundle_name.strip() or "/" in o.bundle_name or "\\" in o.bundle_name):
        raise ConfigError("output.bundle_name", f"{shown(o.bundle_name)} must be a non-empty name without / or \\")
    _choice("output.codebook_dtype", o.codebook_dtype, DTYPE_NAMES)
    s = o.serving
    values = {
        "sink_tokens": d.sink_tokens if s.sink_tokens is None else s.sink_tokens,
        "recent_window": s.recent_window,
        "page_size": s.page_size,
    }
    for name, value in values.items():
        _positive(f"output.serving.{name}", value, zero_ok=name != "page_size")
    for name in ("sink_tokens", "recent_window"):
        if values[name] % s.page_size:
            raise ConfigError(f"output.serving.{name}", f"{values[name]} is not a multiple of page_size {s.page_size}")


def validate(cfg: Config) -> Config:
    """Check every value and combination that does not need the model (never changes ``cfg``); returns it."""
    _numbers(cfg)
    _validate_model(cfg.model)
    _validate_data(cfg.data, cfg.finetune.enabled)
    _validate_quant(cfg.quant)
    validate_capture(cfg.capture, cfg.quant)
    _validate_kmeans(cfg.kmeans)
    _validate_tasq(cfg.tasq, cfg.quant)
    validate_finetune(cfg.finetune)
    _validate_output(cfg.output, cfg.data)
    return cfg


def derived_bits(q: QuantConfig) -> float:
    """log2(codebook_size) / group_size (meaningful once both are validated positive)."""
    return math.log2(q.codebook_size) / q.group_size if q.codebook_size > 0 and q.group_size > 0 else math.nan


def validate_for_model(cfg: Config, head_dim: int, kv_heads: int, *, loop_steps: int, has_prelude: bool) -> None:
    """Checks that need the model's shapes (read from config.json only, before any work)."""
    q = cfg.quant
    c = q.group_size // q.block_steps
    if head_dim % c:
        what = "c = G / T_c" if q.loop_axis else "group_size"
        raise ConfigError("quant.group_size", f"head_dim {head_dim} is not divisible by {what} = {c}")
    if q.loop_axis and loop_steps % q.steps_per_block:
        raise ConfigError(
            "quant.steps_per_block", f"{loop_steps} loop steps cannot be split into blocks of {q.steps_per_block}"
        )
    if has_prelude and q.loop_axis and head_dim % q.group_size:
        raise ConfigError(
            "quant.group_size",
            f"non-looped layers are coded per layer like CQ: head_dim {head_dim} is not divisible by G = "
            f"{q.group_size}",
        )
