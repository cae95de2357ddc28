"""The one config tree of ``loopvq-calibrate``: dataclasses loaded from YAML, checked in one place
(:mod:`loopvq_calib.config_validate`, re-exported here).

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
from .config_validate import (  # noqa: F401  (the checks live in config_validate; importable from here too)
    DTYPES, METHODS, SHARING, STORES, derived_bits, exact_fisher_channels, validate, validate_capture, validate_finetune,
    validate_for_model,
)



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
    selection_batch: int = 4  # selection sequences per forward when measuring the selection KL (memory vs launches)
    parameterization: str = "codewords"  # codewords (every entry free) | affine (per-codebook scale and shift)
    min_usage: int = 0  # codewords: train only entries that >= this many training vectors use (0: all)
    proximal: float = 1.0  # weight of sum ||C - C0||^2 / sum ||C0||^2 toward the k-means codebooks; the paper: 0
    kl_chunk: int = 1024  # positions per chunk of the KL computation
    loop_checkpointing: bool | str = False  # activation checkpointing per loop step: true | false | auto (off until it does not fit)
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
        kinds = [a for a in args if a is not type(None)]
        tp = next((a for a in kinds if type(value) is a), kinds[0])  # bool | str: True stays True, "auto" a str
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
