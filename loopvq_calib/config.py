"""The one config tree of ``loopvq-calibrate``: dataclasses loaded from YAML and validated here only.

Every key is documented in docs/config.md. Errors raise :class:`ConfigError` naming the key path and
what is allowed; the CLI turns them into exit status 2 before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config_source import PATH_KEYS, ConfigError, apply_overrides, copy_sections, read_yaml, resolve_paths

METHODS = ("cq", "tasq", "loopvq", "tasq+loopvq")
SHARING = ("none", "heads", "groups", "all")
DTYPES = ("float32", "bfloat16", "float16")
SEED_LIMIT = 2**32  # seeds any generator accepts (numpy needs < 2**32)
INT_LIMIT = 2**31 - 1


@dataclass
class ModelConfig:
    name_or_path: str = "artifacts/tiny-ouro"  # hub id or local folder
    revision: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    loop_steps: int | None = None  # Ouro total_ut_steps / Huginn recurrences r; None = config.json


@dataclass
class DataConfig:
    dataset: str = "artifacts/data/shakespeare-calib.jsonl"  # hub name, local file, folder or glob
    type: str = "auto"  # auto | hub | text | json | jsonl | parquet
    config_name: str | None = None
    split: str = "train"
    text_field: str = "text"  # column holding the text (with chat_template: the conversation, a list of messages)
    text_sample_by: str = "document"  # for type text: line | paragraph | document
    chat_template: bool = False  # render each row's messages with the tokenizer's chat template (Thinking variants)
    num_sequences: int = 16
    sequence_length: int = 512
    heldout_sequences: int = 4  # of num_sequences, for fine-tuning epoch selection
    seed: int = 0
    sink_tokens: int = 8  # first tokens of each sequence kept in full precision (n_s)


@dataclass
class QuantConfig:
    method: str = "loopvq"  # cq | tasq | loopvq | tasq+loopvq
    bits: float | None = 0.5  # per element; must equal log2(codebook_size) / group_size
    codebook_size: int = 256  # K
    group_size: int = 16  # G coordinates per code
    steps_per_block: int = 4  # T_c (loop-axis methods); cq/tasq use 1
    codebook_sharing: str = "none"  # none | heads | groups | all

    @property
    def loop_axis(self) -> bool:
        return self.method in ("loopvq", "tasq+loopvq")

    @property
    def uses_tasq(self) -> bool:
        return self.method in ("tasq", "tasq+loopvq")

    @property
    def block_steps(self) -> int:
        """Steps coded jointly: T_c for loop-axis methods, 1 for channel-only ones."""
        return self.steps_per_block if self.loop_axis else 1


STORES = ("auto", "device", "memory", "disk")


@dataclass
class CaptureConfig:
    dtype: str = "bfloat16"  # storage dtype of captured K/V and Fisher
    batch_size: int = 1  # sequences per forward/backward
    store: str = "auto"  # auto (the first of device, memory, disk that holds it) | device | memory (host RAM) | disk (reusable)
    fisher_channels: int | None = None  # squared gradients summed over this many consecutive channels; null = the largest exact value

    @property
    def channels_per_fisher(self) -> int:
        """``fisher_channels`` as resolved by validation; 1 (per coordinate, always exact) before it."""
        return self.fisher_channels or 1


def exact_fisher_channels(quant: QuantConfig) -> int:
    """The largest ``capture.fisher_channels`` that keeps every code group's Fisher weight exact: the
    channels per step of a group (G / T_c), whose chunks every plain group covers whole. (TaSQ methods store
    their keys' Fisher per RoPE pair whatever this is; it applies to their values.)"""
    return quant.group_size // quant.block_steps


def validate_capture(c: CaptureConfig, q: QuantConfig) -> None:
    """Check ``capture.*`` against ``quant.*`` (``fisher_channels: null`` stands for the exact value)."""
    _choice("capture.dtype", c.dtype, DTYPES)
    _positive("capture.batch_size", c.batch_size)
    _choice("capture.store", c.store, STORES)
    fc = exact_fisher_channels(q) if c.fisher_channels is None else c.fisher_channels
    _positive("capture.fisher_channels", fc)
    if (q.group_size // q.block_steps) % fc:
        raise ConfigError(
            "capture.fisher_channels",
            f"{fc} does not divide the {q.group_size // q.block_steps} channels per step of a code group",
        )


@dataclass
class KMeansConfig:
    backend: str = "auto"  # auto | faiss | torch | triton
    iterations: int = 100
    tolerance: float = 1e-5  # stop when the mean centroid change falls below
    init: str = "kmeans++"  # kmeans++ | random
    fisher_weighted: bool = True
    seed: int = 0
    device: str = "auto"
    problems_per_batch: int | None = None  # torch backend: problems solved together (null: 512 GPU, 8 CPU)
    points_per_chunk: int | None = None  # torch backend: points per problem per distance block (null: 16384 GPU, 512 CPU)


@dataclass
class TasqConfig:
    det_eps: float = 1e-6  # eps in det(Sigma[S,S] + eps I)^(1/|S|)
    sigma_min: float = 1e-4
    weight_floor: float = 1e-6  # query-statistic diagonal floored at this fraction of its max


@dataclass
class FinetuneConfig:
    enabled: bool = True
    epochs: int = 4
    lr: float = 1e-2  # the paper: 1e-3 (docs/finetune.md has the study behind these defaults)
    lr_schedule: str = "cosine"  # constant | cosine | linear (decay after the warm-up); the paper: constant
    warmup_steps: int = 4  # optimizer steps of linear warm-up; the paper: 0
    batch_size: int = 1  # sequences per optimizer step (split across processes)
    select_every: int = 4  # measure the selection KL every N optimizer steps (0: after each epoch, the paper)
    parameterization: str = "codewords"  # codewords (every entry free) | affine (per-codebook scale and shift)
    min_usage: int = 0  # codewords: train only entries that >= this many training vectors use (0: all)
    proximal: float = 1.0  # weight of sum ||C - C0||^2 / sum ||C0||^2 toward the k-means codebooks; the paper: 0
    kl_chunk: int = 1024  # positions per chunk of the KL computation
    loop_checkpointing: bool = False  # activation checkpointing per loop step
    autocast: str = "auto"  # auto (bf16 on GPU) | bfloat16 | none
    cache_teacher: str = "auto"  # keep full-precision outputs across epochs: auto (as many sequences as fit) | true | false
    seed: int = 0


@dataclass
class ServingConfig:
    sink_tokens: int | None = None  # default: data.sink_tokens
    recent_window: int = 64
    page_size: int = 8


@dataclass
class OutputConfig:
    dir: str = "runs/tiny-ouro"
    bundle_name: str | None = None  # default: <model>-<method>-<bits>bit
    codebook_dtype: str = "float16"
    serving: ServingConfig = field(default_factory=ServingConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    kmeans: KMeansConfig = field(default_factory=KMeansConfig)
    tasq: TasqConfig = field(default_factory=TasqConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(where, f"unknown key; allowed here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if value is None:
        raise ConfigError(path, f"must not be null (expected {tp.__name__})")
    if tp is str and isinstance(value, bool):
        return "true" if value else "false"  # YAML reads true/false unquoted as booleans (cache_teacher: true)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-5 as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _choice(path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(path, f"{value!r} is not allowed; choose one of {', '.join(allowed)}")


def _positive(path: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(path, f"must be {'>= 0' if zero_ok else '> 0'}, got {value}")


def _seed(path: str, value: int) -> None:
    if not 0 <= value < SEED_LIMIT:
        raise ConfigError(path, f"must be in [0, 2**32), got {value}")


def _numbers(obj: Any, path: str = "") -> None:
    """Every float finite, every int but the seeds (see _seed) at most INT_LIMIT in magnitude (a typo like
    99999999999 fails here, not hours in)."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{path}{f.name}"
        if dataclasses.is_dataclass(value):
            _numbers(value, key + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(key, f"must be a finite number, got {value}")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT and f.name != "seed":
            raise ConfigError(key, f"{value} is out of range (at most {INT_LIMIT:,})")


def _validate_model(m: ModelConfig) -> None:
    _choice("model.dtype", m.dtype, DTYPES)
    _device("model.device", m.device)
    if m.loop_steps is not None:
        _positive("model.loop_steps", m.loop_steps)
    if not m.name_or_path.strip():
        raise ConfigError("model.name_or_path", "must not be empty")


def _device(key: str, device: str) -> None:
    if device != "auto" and device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(key, f"{device!r} is not allowed; use auto, cpu, cuda or cuda:N")


def _validate_data(d: DataConfig, finetune_enabled: bool) -> None:
    if not d.dataset.strip():
        raise ConfigError("data.dataset", "must not be empty")
    _choice("data.type", d.type, ("auto", "hub", "text", "json", "jsonl", "parquet"))
    _choice("data.text_sample_by", d.text_sample_by, ("line", "paragraph", "document"))
    _positive("data.num_sequences", d.num_sequences)
    _positive("data.sequence_length", d.sequence_length)
    _positive("data.sink_tokens", d.sink_tokens, zero_ok=True)
    _positive("data.heldout_sequences", d.heldout_sequences, zero_ok=True)
    _seed("data.seed", d.seed)
    if d.chat_template and d.type == "text":
        raise ConfigError("data.chat_template", "needs rows of messages (json, jsonl, parquet or a hub dataset), "
                          "not plain text files (data.type text)")
    if d.sink_tokens >= d.sequence_length:
        raise ConfigError("data.sink_tokens", f"{d.sink_tokens} sinks leave no token of a {d.sequence_length}-token sequence to quantize")
    if finetune_enabled and not 0 < d.heldout_sequences < d.num_sequences:
        raise ConfigError(
            "data.heldout_sequences",
            f"fine-tuning needs 0 < heldout_sequences < num_sequences ({d.num_sequences}), got {d.heldout_sequences}",
        )


def _validate_quant(q: QuantConfig) -> None:
    _choice("quant.method", q.method, METHODS)
    _choice("quant.codebook_sharing", q.codebook_sharing, SHARING)
    if q.codebook_size < 2 or q.codebook_size & (q.codebook_size - 1) or q.codebook_size > 65536:
        raise ConfigError("quant.codebook_size", f"must be a power of two in [2, 65536], got {q.codebook_size}")
    _positive("quant.group_size", q.group_size)
    _positive("quant.steps_per_block", q.steps_per_block)
    derived = derived_bits(q)
    if q.bits is not None and not math.isclose(q.bits, derived, rel_tol=1e-9):
        raise ConfigError(
            "quant.bits",
            f"{q.bits} does not match log2(codebook_size)/group_size = log2({q.codebook_size})/{q.group_size} = {derived:g}",
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
            f"TaSQ keeps each RoPE pair in one group: channels per step G/T_c = {q.group_size // q.block_steps} must be even",
        )


def _validate_kmeans(k: KMeansConfig) -> None:
    _choice("kmeans.backend", k.backend, ("auto", "faiss", "torch", "triton"))
    _choice("kmeans.init", k.init, ("kmeans++", "random"))
    _device("kmeans.device", k.device)
    _positive("kmeans.iterations", k.iterations)
    _positive("kmeans.tolerance", k.tolerance, zero_ok=True)
    _seed("kmeans.seed", k.seed)
    for name in ("problems_per_batch", "points_per_chunk"):
        if getattr(k, name) is not None:
            _positive(f"kmeans.{name}", getattr(k, name))


def _validate_tasq(t: TasqConfig) -> None:
    for name in ("det_eps", "sigma_min", "weight_floor"):
        _positive(f"tasq.{name}", getattr(t, name))
    if t.weight_floor >= 1:
        raise ConfigError("tasq.weight_floor", f"is a fraction of the largest weight and must be < 1, got {t.weight_floor}")


def validate_finetune(f: FinetuneConfig) -> None:
    """The ``finetune`` section's own values."""
    _positive("finetune.epochs", f.epochs, zero_ok=True)
    _positive("finetune.lr", f.lr)
    _choice("finetune.lr_schedule", f.lr_schedule, ("constant", "cosine", "linear"))
    _positive("finetune.warmup_steps", f.warmup_steps, zero_ok=True)
    _positive("finetune.batch_size", f.batch_size)
    _positive("finetune.select_every", f.select_every, zero_ok=True)
    _choice("finetune.parameterization", f.parameterization, ("codewords", "affine"))
    _positive("finetune.min_usage", f.min_usage, zero_ok=True)
    if f.min_usage and f.parameterization != "codewords":
        raise ConfigError("finetune.min_usage", f"{f.min_usage} restricts codewords; it needs parameterization "
                          f"codewords, not {f.parameterization}")
    _positive("finetune.proximal", f.proximal, zero_ok=True)
    _positive("finetune.kl_chunk", f.kl_chunk)
    _seed("finetune.seed", f.seed)
    _choice("finetune.autocast", f.autocast, ("auto", "bfloat16", "none"))
    _choice("finetune.cache_teacher", f.cache_teacher, ("auto", "true", "false"))


def _validate_output(o: OutputConfig, d: DataConfig) -> None:
    if not o.dir.strip():
        raise ConfigError("output.dir", "must not be empty")
    if o.bundle_name is not None and (not o.bundle_name.strip() or "/" in o.bundle_name or "\\" in o.bundle_name):
        raise ConfigError("output.bundle_name", f"{o.bundle_name!r} must be a non-empty name without / or \\")
    _choice("output.codebook_dtype", o.codebook_dtype, DTYPES)
    s = o.serving
    values = {"sink_tokens": d.sink_tokens if s.sink_tokens is None else s.sink_tokens,
              "recent_window": s.recent_window, "page_size": s.page_size}
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
    _validate_tasq(cfg.tasq)
    validate_finetune(cfg.finetune)
    _validate_output(cfg.output, cfg.data)
    return cfg


def derived_bits(q: QuantConfig) -> float:
    """log2(codebook_size) / group_size (meaningful once both are validated positive)."""
    return math.log2(q.codebook_size) / q.group_size if q.codebook_size > 0 and q.group_size > 0 else math.nan


def validate_for_model(cfg: Config, head_dim: int, kv_heads: int, loop_steps: int, has_prelude: bool) -> None:
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
            f"non-looped layers are coded per layer like CQ: head_dim {head_dim} is not divisible by G = {q.group_size}",
        )


def load_config(source: str | Path | dict, overrides: list[str] | None = None) -> Config:
    """Load YAML (a path or an already-parsed mapping), apply ``key.path=value`` overrides, resolve the
    derived values and the paths, validate (the one validation pass; nothing is touched on disk).

    Relative local paths written in a config file resolve against the file's folder; those from ``--set``,
    from a mapping and the defaults against the current directory (docs/config.md, "Paths")."""
    if isinstance(source, dict):
        raw, base = source, Path.cwd()
    else:
        path = Path(source)
        raw, base = read_yaml(path), path.absolute().parent
    if not isinstance(raw, dict):
        raise ConfigError("", f"the top level of the config must be a mapping of sections, got {type(raw).__name__}")
    raw = resolve_paths(copy_sections(raw), base)
    overridden = {k for k in PATH_KEYS if any(o.split("=", 1)[0].strip() == k for o in overrides or [])}
    raw = apply_overrides(raw, overrides or [])
    raw = resolve_paths(raw, Path.cwd(), tuple(sorted(overridden | _fill_path_defaults(raw))))
    return validate(resolve_derived(_build(Config, raw, "")))


def resolve_derived(cfg: Config) -> Config:
    """Fill the values a config may leave null: ``quant.bits`` (from K and G),
    ``output.serving.sink_tokens`` (= ``data.sink_tokens``) and ``capture.fisher_channels`` (the largest exact
    value, :func:`exact_fisher_channels`). The only place the loader changes values."""
    if cfg.quant.bits is None and math.isfinite(derived_bits(cfg.quant)):
        cfg.quant.bits = derived_bits(cfg.quant)
    if cfg.capture.fisher_channels is None and cfg.quant.group_size > 0 and cfg.quant.block_steps > 0:
        cfg.capture.fisher_channels = exact_fisher_channels(cfg.quant)
    if cfg.output.serving.sink_tokens is None:
        cfg.output.serving.sink_tokens = cfg.data.sink_tokens
    return cfg


def _fill_path_defaults(raw: dict) -> set[str]:
    """Put the default of every path key the config leaves out into ``raw``; returns those keys."""
    filled = set()
    for key in PATH_KEYS:
        section, name = key.split(".")
        node = raw.setdefault(section, {})
        if isinstance(node, dict) and name not in node:
            node[name] = getattr(getattr(Config(), section), name)
            filled.add(key)
    return filled


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written to every run directory)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
