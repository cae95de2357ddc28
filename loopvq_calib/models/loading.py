"""Load a looped model by hub id or folder, check a model folder's files before any work, and compute the
identity a bundle is tied to.

:func:`check_model_folder` reads what a run needs without loading weights (models/files.py): every entry a regular
file, config.json (UTF-8, JSON, a ``model_type`` of models/registry.py, sizes within the caps of models/limits.py, a
config transformers accepts), the weight files (every shard the index names present, each safetensors header whole and
its tensors inside the file) and the tokenizer's files. Each failure is a :class:`ModelLoadError` naming the
config key or flag and the file."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config.schema import DTYPE_NAMES
from ..config.source import first_line, looks_local, shown
from .files import (
    WEIGHTS_INDEX,
    ModelLoadError,
    check_folder_entries,
    check_tokenizer_files,
    config_sha256,
    content_hash,
    read_config_json,
    safetensors_header,
    weight_files,
    weight_shapes,
)
from .limits import check_config_sizes
from .registry import architecture_of, find_architecture, model_types

__all__ = [
    "WEIGHTS_INDEX",
    "ModelIdentity",
    "ModelLoadError",
    "check_model_folder",
    "check_weights_match",
    "hub_snapshot",
    "load_model",
    "load_tokenizer",
    "model_identity",
    "model_skeleton",
    "model_window",
    "pick_device",
    "read_model_config",
    "resolve_model_dir",
    "weight_files",
]
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the config's dtype names as torch dtypes


def resolve_model_dir(name_or_path: str, revision: str | None = None, key: str = "model.name_or_path") -> Path:
    """A local folder as is; a hub id through the hub cache (snapshot_download; read from the cache only
    under HF_HUB_OFFLINE=1). A local-looking path that does not exist is reported as such, never as a
    network error (see :func:`loopvq_calib.config.source.looks_local`), and one the file system refuses (too
    long) names ``key``."""
    path = Path(name_or_path).expanduser()
    try:
        if path.is_dir():
            return path
        exists = path.exists()
    except OSError as err:
        raise ModelLoadError(
            f"{key}: cannot use {shown(name_or_path)} as a model folder ({err.strerror or type(err).__name__})"
        ) from None
    if exists:
        raise ModelLoadError(f"{key}: {name_or_path} is a file, not a model folder")
    if looks_local(name_or_path, Path.cwd()):
        raise ModelLoadError(
            f"{key}: no such folder: {name_or_path}" + ("" if path.is_absolute() else f" (relative to {Path.cwd()})")
        )
    return Path(
        hub_snapshot(
            name_or_path,
            revision,
            key,
            what="model",
            patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"],
        )
    )


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set to a true value (1, true, yes, on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(repo_id: str, revision: str | None, key: str, *, what: str, patterns: list[str] | None = None) -> str:
    """snapshot_download of a hub model repo into the hub cache; any failure is a ModelLoadError naming ``key``
    and the id (offline: says it is not in the local cache)."""
    offline = hub_offline()
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=offline, allow_patterns=patterns)
    except Exception as err:
        local = (
            "--set model.name_or_path=<local folder>"
            if key == "model.name_or_path"
            else f"pass a local folder to {key}"
            if key.startswith("--")
            else "give a local folder instead"
        )
        hint = (
            f" (offline mode: HF_HUB_OFFLINE is set and {shown(repo_id)} is not in the local hub cache); "
            f"{local}, or unset HF_HUB_OFFLINE to download it"
            if offline
            else f" ({type(err).__name__}: {first_line(err)}); {local}, or check the network"
        )
        at = f" at revision {shown(revision)}" if revision is not None else ""
        raise ModelLoadError(
            f"{key}: could not get the {what} {shown(repo_id)}{at} from the Hugging Face Hub{hint}"
        ) from err


@dataclass
class ModelIdentity:
    """What ties a bundle to a model: config hash, weight files (name, size, header hash), name, revision."""

    name: str
    revision: str | None
    model_type: str
    config_sha256: str
    weights: list[dict[str, Any]]

    @property
    def weights_sha256(self) -> str:
        """sha256 of the weight file descriptions (one hash to compare)."""
        return hashlib.sha256(json.dumps(self.weights, sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """The ``model`` entry of a bundle's ``loopvq.json``."""
        return {
            "name": self.name,
            "revision": self.revision,
            "model_type": self.model_type,
            "config_sha256": self.config_sha256,
            "weights_sha256": self.weights_sha256,
            "weights": self.weights,
        }


def model_identity(folder: Path, name: str, revision: str | None = None) -> ModelIdentity:
    """Hash config.json and describe each safetensors file by name, size, header hash (tensor names,
    dtypes, shapes, offsets) and a content hash (:func:`~loopvq_calib.models.files.content_hash`): cheap even for
    15 GB checkpoints."""
    weights = [
        {
            "file": p.name,
            "bytes": p.stat().st_size,
            "header_sha256": hashlib.sha256(safetensors_header(p)).hexdigest(),
            **content_hash(p),
        }
        for p in sorted(folder.glob("*.safetensors"))
    ]
    model_type = read_config_json(folder).get("model_type", "")
    return ModelIdentity(name, revision, model_type, config_sha256(folder), weights)


def read_model_config(folder: Path, key: str = "model.name_or_path") -> Any:
    """config.json as a transformers config (no weights read; its architecture registered itself with AutoConfig:
    models/registry.py); errors name the file."""
    raw = read_config_json(folder, key)
    if find_architecture(raw.get("model_type")) is None:
        raise ModelLoadError(
            f"{key}: model_type {shown(raw.get('model_type'))} in {folder}/config.json is not a supported looped "
            f"model; supported: {', '.join(model_types())}"
        )
    check_config_sizes(raw, folder / "config.json", key)
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, OSError) as err:
        raise ModelLoadError(f"{key}: {folder}/config.json: {first_line(err)}") from err


def model_window(config: Any) -> tuple[int, str]:
    """The longest sequence the model takes (its RoPE and position range) and the config.json field it comes
    from: Ouro ``max_position_embeddings``, Huginn ``block_size``; anything but a positive integer there is a
    ModelLoadError naming the field and the file."""
    return architecture_of(config).window(config)


def check_model_folder(folder: Path, key: str = "model.name_or_path") -> Any:
    """Every file a run reads from a model folder, checked without loading weights (module docstring);
    returns the transformers config."""
    check_folder_entries(folder, key)
    config = read_model_config(folder, key)
    for path in weight_files(folder, key):
        safetensors_header(path, key)
    check_tokenizer_files(folder, key)
    return config


def model_skeleton(model_config: Any, key: str = "model.name_or_path") -> torch.nn.Module:
    """The model ``model_config`` describes, built on the meta device (no memory, no weights read); a config.json
    that builds no model is a ModelLoadError naming it."""
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as err:
        where = Path(model_config.name_or_path) / "config.json"
        raise ModelLoadError(
            f"{key}: {where} describes no model that can be built: {type(err).__name__}: {first_line(err)}"
        ) from err


def check_weights_match(model: torch.nn.Module, folder: Path, key: str = "model.name_or_path") -> None:
    """The folder's weights are this model's (read from the safetensors headers: no weights loaded): a config.json
    whose ``model_type`` builds a model most of whose parameters have no tensor of that name in the shards
    (another architecture's weights) is a ModelLoadError, and so is a tensor whose shape in the shards is not the
    one config.json gives it. Half is the bar for names, so tied or renamed tensors that transformers maps on
    loading never trip it."""
    expected = dict(model.named_parameters())
    present = weight_shapes(folder, key)
    missing = [name for name in expected if name not in present]
    if expected and len(missing) * 2 > len(expected):
        raise ModelLoadError(
            f"{key}: the weights in {folder} are not those of its config.json's model_type "
            f"{shown(model.config.model_type)}: {len(missing)} of the {len(expected)} tensors it "
            f"needs are not in the weight files (e.g. {', '.join(missing[:3])})"
        )
    for name, param in expected.items():
        if name in present and present[name][1] != list(param.shape):
            file, shape = present[name]
            raise ModelLoadError(
                f"{key}: {file}: tensor {shown(name)} has shape {shape}, but {folder}/config.json "
                f"describes a model whose {name} is {list(param.shape)} (config.json and the "
                "weights disagree)"
            )


def load_tokenizer(folder: Path, key: str = "model.name_or_path") -> Any:
    """The model folder's tokenizer; a tokenizer that does not load is a ModelLoadError naming the folder."""
    check_tokenizer_files(folder, key)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # transformers raises many kinds here (ValueError, OSError, ImportError, ...)
        raise ModelLoadError(
            f"{key}: the tokenizer in {folder} does not load: {type(err).__name__}: {first_line(err)}"
        ) from err


def set_loop_steps(model: torch.nn.Module, steps: int | None) -> None:
    """Override the loop count (the model's ``set_loop_steps`` hook) unless ``steps`` is None."""
    if steps is not None:
        model.set_loop_steps(steps)


def pick_device(device: str, key: str = "model.device") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; a CUDA device without CUDA is an error naming ``key``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"{key}: {device!r} asked for, but no CUDA device is available")
    return torch.device(device)


def load_model(
    folder: Path, dtype: str, device: torch.device, *, loop_steps: int | None = None, key: str = "model.name_or_path"
) -> tuple[Any, Any]:
    """(model in eval mode with frozen weights, tokenizer) from a hub-layout folder, checked first
    (:func:`check_model_folder`)."""
    check_weights_match(model_skeleton(check_model_folder(folder, key), key), folder, key)
    # read straight onto the device (the same tensors as loading on the CPU and moving the model there)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[dtype], device_map={"": str(device)}).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    set_loop_steps(model, loop_steps)
    return model, load_tokenizer(folder, key)
