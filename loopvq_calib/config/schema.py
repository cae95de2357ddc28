"""The one config tree of ``loopvq-calibrate`` as dataclasses, and the choices its keys allow.

Every key is documented in docs/config.md; :mod:`~loopvq_calib.config.load` builds the tree from YAML and
:mod:`~loopvq_calib.config.validate` checks it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .methods import DEFAULT_METHOD, QuantMethod, get_method, method_names

SHARING = ("none", "heads", "groups", "all")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
CAPTURE_STORES = ("auto", "device", "memory", "disk")
KMEANS_BACKENDS = ("auto", "faiss", "torch", "triton")
KMEANS_INITS = ("kmeans++", "random")
DATA_TYPES = ("auto", "hub", "text", "json", "jsonl", "parquet")
TEXT_SAMPLE_BY = ("line", "paragraph", "document")
LR_SCHEDULES = ("constant", "cosine", "linear")
PARAMETERIZATIONS = ("codewords", "affine")
AUTOCAST_MODES = ("auto", "bfloat16", "none")
CACHE_TEACHER = ("auto", "true", "false")


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
    method: str = DEFAULT_METHOD  # a method registered in config/methods.py
    bits: float | None = 0.5  # per element; must equal log2(codebook_size) / group_size
    codebook_size: int = 256  # K
    group_size: int = 16  # G coordinates per code
    steps_per_block: int = 4  # T_c (loop-axis methods); channel-only methods use 1
    codebook_sharing: str = "none"  # none | heads | groups | all

    @property
    def declaration(self) -> QuantMethod | None:
        """The method's declaration (:mod:`loopvq_calib.config.methods`); None while ``method`` names none (a config
        not validated yet)."""
        return get_method(self.method) if self.method in method_names() else None

    @property
    def loop_axis(self) -> bool:
        """Whether codes span loop steps (the method's declaration says)."""
        return self.declaration is not None and self.declaration.loop_axis

    @property
    def uses_tasq(self) -> bool:
        """Whether the method has a TaSQ stage (the method's declaration says)."""
        return self.declaration is not None and self.declaration.uses_tasq

    @property
    def block_steps(self) -> int:
        """Steps coded jointly: T_c for loop-axis methods, 1 for channel-only ones."""
        return self.steps_per_block if self.loop_axis else 1


@dataclass
class CaptureConfig:
    dtype: str = "bfloat16"  # storage dtype of captured K/V and Fisher
    batch_size: int = 1  # sequences per forward/backward
    # auto (the first of device, memory, disk that holds it) | device | memory (host RAM) | disk (reusable)
    store: str = "auto"
    # squared gradients summed over this many consecutive channels; null = the largest exact value
    fisher_channels: int | None = None

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
    # torch backend: points per problem per distance block (null: 16384 GPU, 512 CPU)
    points_per_chunk: int | None = None


@dataclass
class TasqConfig:
    grouping: str = "free"  # free: RoPE pairs of any step merge | channels: the same channels at every step of a block
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
    # activation checkpointing per loop step: true | false | auto (off until it does not fit)
    loop_checkpointing: bool | str = False
    autocast: str = "auto"  # auto (bf16 on GPU) | bfloat16 | none
    # keep full-precision outputs across epochs: auto (as many sequences as fit) | true | false
    cache_teacher: str = "auto"
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
        """The tree as nested plain dicts (what run directories and bundles record)."""
        return dataclasses.asdict(self)
