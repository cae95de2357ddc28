"""Load a looped model by hub id or folder, check a model folder's files before any work, and compute the
identity a bundle is tied to.

:func:`check_model_folder` reads what a run needs without loading weights: config.json (UTF-8, JSON, a supported
``model_type``, a config transformers accepts), the weight files (every shard the index names present, each
safetensors header whole and its tensors inside the file) and the tokenizer's files. Each failure is a
:class:`ModelLoadError` naming the config key or flag and the file."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..config.schema import DTYPE_NAMES
from ..config.source import first_line, looks_local, shown

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the config's dtype names as torch dtypes
NATIVE_TYPES = ("ouro", "huginn_raven")
WEIGHTS_INDEX = "model.safetensors.index.json"
# any one of these makes a tokenizer (fast tokenizer.json, sentencepiece, BPE vocab + merges, WordPiece vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
WINDOW_FIELDS = {"ouro": "max_position_embeddings", "huginn_raven": "block_size"}  # config.json's window


class ModelLoadError(RuntimeError):
    """The model cannot be found, a file of its folder is missing or broken, or it is not a supported looped
    architecture; names the config key (or flag) and the file."""


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
        raise ModelLoadError(f"{key}: cannot use {shown(name_or_path)} as a model folder "
                             f"({err.strerror or type(err).__name__})") from None
    if exists:
        raise ModelLoadError(f"{key}: {name_or_path} is a file, not a model folder")
    if looks_local(name_or_path, Path.cwd()):
        raise ModelLoadError(f"{key}: no such folder: {name_or_path}"
                             + ("" if path.is_absolute() else f" (relative to {Path.cwd()})"))
    return Path(hub_snapshot(name_or_path, revision, key, what="model",
                             patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]))


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
        hint = (f" (offline mode: HF_HUB_OFFLINE is set and {shown(repo_id)} is not in the local hub cache)"
                if offline else f" ({type(err).__name__}: {first_line(err)})")
        raise ModelLoadError(f"{key}: could not get the {what} {shown(repo_id)} (revision {shown(revision)}) from "
                             f"the Hugging Face Hub{hint}") from err


SAMPLE_CHUNKS = 64
SAMPLE_BYTES = 1 << 16


def _safetensors_header_hash(path: Path) -> str:
    return hashlib.sha256(safetensors_header(path)).hexdigest()


def safetensors_header(path: Path, key: str = "") -> bytes:
    """The JSON header of a safetensors file, checked: whole, valid JSON, every tensor's bytes inside the file
    (a truncated or cut download fails here, naming the file, instead of deep inside the loader)."""
    where = f"{key}: {path}" if key else str(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        if size < 8:
            raise ModelLoadError(f"{where}: not a safetensors file ({size} bytes; truncated?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ModelLoadError(f"{where}: truncated: its header says {n:,} bytes, the file holds {size - 8:,} after "
                                 "the length")
        header = f.read(n)
    try:
        entries = json.loads(header.decode("utf-8"))
        ends = [int(e["data_offsets"][1]) for name, e in entries.items() if name != "__metadata__"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise ModelLoadError(f"{where}: not a safetensors file (its header is no valid tensor table: "
                             f"{type(err).__name__})") from err
    if 8 + n + max(ends, default=0) > size:
        raise ModelLoadError(f"{where}: truncated: its tensors need {8 + n + max(ends):,} bytes, the file has "
                             f"{size:,}")
    return header


def _content_hash(path: Path) -> dict[str, str]:
    """``sample_sha256``: a sha256 over 64 evenly spaced 64 KiB chunks, which any change of the weight
    values (a fine-tune) alters; plus ``sha256``, the whole file's, when the hub cache names the blob by it
    (free). The sampled hash is always there, so a hub-cache copy and a plain copy of the same files compare."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with path.open("rb") as f:
        for i in range(SAMPLE_CHUNKS):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // max(SAMPLE_CHUNKS - 1, 1)))
            h.update(f.read(SAMPLE_BYTES))
    out = {"sample_sha256": h.hexdigest()}
    target = path.resolve()
    if target != path.absolute() and len(target.name) == 64 and all(c in "0123456789abcdef" for c in target.name):
        out["sha256"] = target.name
    return out


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
            "name": self.name, "revision": self.revision, "model_type": self.model_type,
            "config_sha256": self.config_sha256, "weights_sha256": self.weights_sha256, "weights": self.weights,
        }


def model_identity(folder: Path, name: str, revision: str | None = None) -> ModelIdentity:
    """Hash config.json and describe each safetensors file by name, size, header hash (tensor names,
    dtypes, shapes, offsets) and a content hash (:func:`_content_hash`): cheap even for 15 GB checkpoints."""
    config_bytes = (folder / "config.json").read_bytes()
    weights = [
        {"file": p.name, "bytes": p.stat().st_size, "header_sha256": _safetensors_header_hash(p), **_content_hash(p)}
        for p in sorted(folder.glob("*.safetensors"))
    ]
    model_type = read_config_json(folder).get("model_type", "")
    return ModelIdentity(name, revision, model_type, hashlib.sha256(config_bytes).hexdigest(), weights)


def read_config_json(folder: Path, key: str = "") -> dict[str, Any]:
    """config.json's mapping; a missing, non-UTF-8, invalid or non-object file is a ModelLoadError naming the
    file and where in it."""
    path = folder / "config.json"
    where = f"{key}: {path}" if key else str(path)
    if not path.is_file():
        raise ModelLoadError(f"{key + ': ' if key else ''}{folder} has no config.json")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ModelLoadError(f"{where} is not UTF-8 text (byte {err.start}: {err.object[err.start:err.start + 1]!r})"
                             ) from err
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{where} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from err
    except RecursionError as err:
        raise ModelLoadError(f"{where} is nested too deeply to read") from err
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where} must hold a JSON object, not {type(raw).__name__}")
    return raw


def read_model_config(folder: Path, key: str = "model.name_or_path") -> Any:
    """config.json as a transformers config (no weights read; the models package registered ouro and
    huginn_raven with AutoConfig when this module was imported); errors name the file."""
    raw = read_config_json(folder, key)
    if raw.get("model_type") not in NATIVE_TYPES:
        raise ModelLoadError(
            f"{key}: model_type {shown(raw.get('model_type'))} in {folder}/config.json is not a supported looped "
            f"model; supported: {', '.join(NATIVE_TYPES)}"
        )
    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, OSError) as err:
        raise ModelLoadError(f"{key}: {folder}/config.json: {first_line(err)}") from err


def model_window(config: Any) -> tuple[int, str]:
    """The longest sequence the model takes (its RoPE and position range) and the config.json field it comes
    from: Ouro ``max_position_embeddings``, Huginn ``block_size``; anything but a positive integer there is a
    ModelLoadError naming the field and the file."""
    name = WINDOW_FIELDS[config.model_type]
    window = getattr(config, name, None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        where = Path(getattr(config, "name_or_path", "") or ".") / "config.json"
        raise ModelLoadError(f"{where}: field {name} (the model's window) must be a positive integer, got "
                             f"{shown(window)}")
    return window, name


def check_model_folder(folder: Path, key: str = "model.name_or_path") -> Any:
    """Every file a run reads from a model folder, checked without loading weights (module docstring);
    returns the transformers config."""
    config = read_model_config(folder, key)
    check_weight_files(folder, key)
    check_tokenizer_files(folder, key)
    return config


def weight_files(folder: Path, key: str = "model.name_or_path") -> list[Path]:
    """The safetensors files of a model folder: the shards ``model.safetensors.index.json`` names (each must be
    there, a plain file name in the folder), else every ``*.safetensors``; none is an error."""
    index = folder / WEIGHTS_INDEX
    if not index.is_file():
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            raise ModelLoadError(f"{key}: {folder} has no weights (model.safetensors, or {WEIGHTS_INDEX} and the "
                                 "shards it names)")
        return found
    try:
        weight_map = json.loads(index.read_bytes().decode("utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ModelLoadError(f"{key}: {index} is not a valid weight index (JSON with a weight_map of tensor -> "
                             f"file): {type(err).__name__}") from err
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ModelLoadError(f"{key}: {index} names {shown(shard)}, not a file name in {folder}")
        if not (folder / shard).is_file():
            raise ModelLoadError(f"{key}: {folder / shard} is missing ({WEIGHTS_INDEX} names it)")
    return [folder / shard for shard in shards]


def check_weight_files(folder: Path, key: str = "model.name_or_path") -> None:
    """Every weight file there (:func:`weight_files`) and whole (:func:`safetensors_header`)."""
    for path in weight_files(folder, key):
        safetensors_header(path, key)


def weight_names(folder: Path, key: str = "model.name_or_path") -> set[str]:
    """The names of every tensor the folder's weight files hold (read from their checked headers)."""
    names: set[str] = set()
    for path in weight_files(folder, key):
        names.update(name for name in json.loads(safetensors_header(path, key)) if name != "__metadata__")
    return names


def check_weights_match(model: torch.nn.Module, folder: Path, key: str = "model.name_or_path") -> None:
    """The folder's weights are this model's: a config.json whose ``model_type`` builds a model most of whose
    parameters have no tensor of that name in the shards (another architecture's weights) is a ModelLoadError.
    Half is the bar, so tied or renamed tensors that transformers maps on loading never trip it."""
    expected = [name for name, _ in model.named_parameters()]
    present = weight_names(folder, key)
    missing = [name for name in expected if name not in present]
    if expected and len(missing) * 2 > len(expected):
        raise ModelLoadError(f"{key}: the weights in {folder} are not those of its config.json's model_type "
                             f"{shown(model.config.model_type)}: {len(missing)} of the {len(expected)} tensors it "
                             f"needs are not in the weight files (e.g. {', '.join(missing[:3])})")


def check_tokenizer_files(folder: Path, key: str = "model.name_or_path") -> None:
    """The folder holds a tokenizer's files (one of TOKENIZER_FILES, or a ``*.tiktoken``)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelLoadError(f"{key}: {folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} or *.tiktoken "
                             "is there (copy the tokenizer's files from the model's hub repo)")


def load_tokenizer(folder: Path, key: str = "model.name_or_path") -> Any:
    """The model folder's tokenizer; a tokenizer that does not load is a ModelLoadError naming the folder."""
    check_tokenizer_files(folder, key)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # transformers raises many kinds here (ValueError, OSError, ImportError, ...)
        raise ModelLoadError(f"{key}: the tokenizer in {folder} does not load: {type(err).__name__}: "
                             f"{first_line(err)}") from err


def set_loop_steps(model: torch.nn.Module, steps: int | None) -> None:
    """Override the loop count (Ouro ``total_ut_steps``, Huginn recurrences ``mean_recurrence``)."""
    if steps is None:
        return
    attr = "total_ut_steps" if model.config.model_type == "ouro" else "mean_recurrence"
    setattr(model.config, attr, steps)


def pick_device(device: str, key: str = "model.device") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; a CUDA device without CUDA is an error naming ``key``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"{key}: {device!r} asked for, but no CUDA device is available")
    return torch.device(device)


def load_model(folder: Path, dtype: str, device: torch.device, *, loop_steps: int | None = None,
               key: str = "model.name_or_path") -> tuple[Any, Any]:
    """(model in eval mode with frozen weights, tokenizer) from a hub-layout folder, checked first
    (:func:`check_model_folder`)."""
    check_model_folder(folder, key)
    # read straight onto the device (the same tensors as loading on the CPU and moving the model there)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[dtype], device_map={"": str(device)}).eval()
    check_weights_match(model, folder, key)
    for p in model.parameters():
        p.requires_grad_(False)
    set_loop_steps(model, loop_steps)
    return model, load_tokenizer(folder, key)
