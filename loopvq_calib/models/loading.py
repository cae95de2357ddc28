"""Load a looped model by hub id or folder, and compute the identity a bundle is tied to."""

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
from ..config.source import looks_local

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the config's dtype names as torch dtypes
NATIVE_TYPES = ("ouro", "huginn_raven")


class ModelLoadError(RuntimeError):
    """The model cannot be found or is not a supported looped architecture; names the config key."""


def resolve_model_dir(name_or_path: str, revision: str | None = None, key: str = "model.name_or_path") -> Path:
    """A local folder as is; a hub id through the hub cache (snapshot_download; read from the cache only
    under HF_HUB_OFFLINE=1). A local-looking path that does not exist is reported as such, never as a
    network error (see :func:`loopvq_calib.config.source.looks_local`)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
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
        hint = (f" (offline mode: HF_HUB_OFFLINE is set and {repo_id} is not in the local hub cache)" if offline
                else f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        raise ModelLoadError(f"{key}: could not get the {what} {repo_id!r} (revision {revision!r}) from the "
                             f"Hugging Face Hub{hint}") from err


SAMPLE_CHUNKS = 64
SAMPLE_BYTES = 1 << 16


def _safetensors_header_hash(path: Path) -> str:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(n)).hexdigest()


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
    model_type = json.loads(config_bytes).get("model_type", "")
    return ModelIdentity(name, revision, model_type, hashlib.sha256(config_bytes).hexdigest(), weights)


def read_model_config(folder: Path, key: str = "model.name_or_path") -> Any:
    """config.json as a transformers config (no weights read; the models package registered ouro and
    huginn_raven with AutoConfig when this module was imported)."""
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    if raw is None:
        raise ModelLoadError(f"{key}: {folder} has no config.json")
    if raw.get("model_type") not in NATIVE_TYPES:
        raise ModelLoadError(
            f"{key}: model_type {raw.get('model_type')!r} in {folder}/config.json is not a supported looped "
            f"model; supported: {', '.join(NATIVE_TYPES)}"
        )
    return AutoConfig.from_pretrained(folder)


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


def load_model(folder: Path, dtype: str, device: torch.device, *, loop_steps: int | None = None) -> tuple[Any, Any]:
    """(model in eval mode with frozen weights, tokenizer) from a hub-layout folder."""
    read_model_config(folder)
    # read straight onto the device (the same tensors as loading on the CPU and moving the model there)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=TORCH_DTYPES[dtype], device_map={"": str(device)}).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    set_loop_steps(model, loop_steps)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
