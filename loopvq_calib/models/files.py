"""A model folder's files, checked and read with a bound (runtime/input_files.py) without loading weights: every entry a
regular file (or a link to one), config.json (UTF-8, JSON, numbers bounded), the weight files (every shard the
index names present, each safetensors header whole, its tensors inside the file, their shapes), the tokenizer's
files, and the hashes the model identity takes of them. Each failure is a
:class:`ModelLoadError` naming the config key (or flag) and the file."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config.source import cut, shown
from ..runtime.input_files import LIMITS, check_regular, long_number, open_regular, parse_json, read_capped

WEIGHTS_INDEX = "model.safetensors.index.json"
# any one of these makes a tokenizer (fast tokenizer.json, sentencepiece, BPE vocab + merges, WordPiece vocab)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
SAMPLE_CHUNKS = 64
SAMPLE_BYTES = 1 << 16


class ModelLoadError(RuntimeError):
    """The model cannot be found, a file of its folder is missing or broken, or it is not a supported looped
    architecture; names the config key (or flag) and the file."""


def keyed(key: str) -> Callable[[str], ModelLoadError]:
    """The error factory of runtime/input_files.py for a file named by ``key`` (no key: the message as is)."""
    return lambda problem: ModelLoadError(f"{key}: {problem}" if key else problem)


def check_folder_entries(folder: Path, key: str = "model.name_or_path") -> None:
    """Every file directly in the model folder (hidden ones aside) is a regular file, or a link to one (the hub
    cache's layout), and all but the weights hold at most the tokenizer-file bound (what transformers reads whole):
    a FIFO, a device or a huge file that transformers or a hash would read is refused before it is opened."""
    try:
        entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as err:
        raise ModelLoadError(f"{key}: cannot list {folder} ({err.strerror or type(err).__name__})") from None
    limit = LIMITS["tokenizer file"]
    for entry in entries:
        if entry.is_dir():
            continue
        size = check_regular(entry, error=keyed(key)).st_size
        if entry.suffix != ".safetensors" and size > limit:
            raise ModelLoadError(
                f"{key}: {entry} holds {size:,} bytes, more than a model folder's file other than "
                f"its weights may hold ({limit:,})"
            )


def read_config_json(folder: Path, key: str = "") -> dict[str, Any]:
    """config.json's mapping; a missing, oversized, non-UTF-8, invalid or non-object file, or a number too long to
    convert, is a ModelLoadError naming the file and where in it."""
    path = folder / "config.json"
    where = f"{key}: {path}" if key else str(path)
    if not os.path.lexists(path):
        raise ModelLoadError(f"{key + ': ' if key else ''}{folder} has no config.json")
    data = read_capped(path, "model JSON file", error=keyed(key))
    try:
        raw = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ModelLoadError(
            f"{where} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 1]!r})"
        ) from err
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{where} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from err
    except RecursionError as err:
        raise ModelLoadError(f"{where} is nested too deeply to read") from err
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{where} must hold a JSON object, not {type(raw).__name__}")
    found = long_number(raw)
    if found is not None:
        raise ModelLoadError(f"{where}: field {cut(found[0], 120)} is {found[1].describe()}")
    return raw


def config_sha256(folder: Path) -> str:
    """sha256 of config.json's bytes (read with its bound)."""
    return hashlib.sha256(read_capped(folder / "config.json", "model JSON file", error=keyed(""))).hexdigest()


def safetensors_header(path: Path, key: str = "") -> bytes:
    """The JSON header of a safetensors file, checked: a regular file, the header whole (at most 100 MiB), valid
    JSON, every tensor's bytes inside the file (a truncated or cut download fails here, naming the file, instead
    of deep inside the loader)."""
    header, _ = _header(path, key)
    return header


def safetensors_shapes(path: Path, key: str = "") -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's checked header (no weights read)."""
    return _header(path, key)[1]


def _header(path: Path, key: str) -> tuple[bytes, dict[str, list[int]]]:
    where = f"{key}: {path}" if key else str(path)
    with open_regular(path, error=keyed(key)) as f:
        size = f.seek(0, 2)
        f.seek(0)
        if size < 8:
            raise ModelLoadError(f"{where}: not a safetensors file ({size} bytes; truncated?)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ModelLoadError(
                f"{where}: truncated: its header says {n:,} bytes, the file holds {size - 8:,} after the length"
            )
        if n > LIMITS["safetensors header"]:
            raise ModelLoadError(
                f"{where}: its header says {n:,} bytes, more than a safetensors header may hold "
                f"({LIMITS['safetensors header']:,})"
            )
        header = f.read(n)
    try:
        entries = parse_json(header.decode("utf-8"))
        tensors = {name: e for name, e in entries.items() if name != "__metadata__"}
        ends = [int(e["data_offsets"][1]) for e in tensors.values()]
        shapes = {name: [int(d) for d in e["shape"]] for name, e in tensors.items()}
        if long_number(tensors) is not None:
            raise ValueError("a number too long")
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        raise ModelLoadError(
            f"{where}: not a safetensors file (its header is no valid tensor table: {type(err).__name__})"
        ) from err
    if 8 + n + max(ends, default=0) > size:
        raise ModelLoadError(f"{where}: truncated: its tensors need {8 + n + max(ends):,} bytes, the file has {size:,}")
    return header, shapes


def content_hash(path: Path) -> dict[str, str]:
    """``sample_sha256``: a sha256 over 64 evenly spaced 64 KiB chunks, which any change of the weight
    values (a fine-tune) alters; plus ``sha256``, the whole file's, when the hub cache names the blob by it
    (free). The sampled hash is always there, so a hub-cache copy and a plain copy of the same files compare."""
    h = hashlib.sha256()
    with open_regular(path, error=keyed("")) as f:
        size = f.seek(0, 2)
        for i in range(SAMPLE_CHUNKS):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // max(SAMPLE_CHUNKS - 1, 1)))
            h.update(f.read(SAMPLE_BYTES))
    out = {"sample_sha256": h.hexdigest()}
    target = path.resolve()
    if target != path.absolute() and len(target.name) == 64 and all(c in "0123456789abcdef" for c in target.name):
        out["sha256"] = target.name
    return out


def weight_files(folder: Path, key: str = "model.name_or_path") -> list[Path]:
    """The safetensors files of a model folder: the shards ``model.safetensors.index.json`` names (each must be
    there, a plain file name in the folder), else every ``*.safetensors``; none is an error."""
    index = folder / WEIGHTS_INDEX
    if not index.exists():
        found = sorted(folder.glob("*.safetensors"))
        if not found:
            raise ModelLoadError(
                f"{key}: {folder} has no weights (model.safetensors, or {WEIGHTS_INDEX} and the shards it names)"
            )
        return found
    try:
        weight_map = parse_json(read_capped(index, "model JSON file", error=keyed(key)).decode("utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as err:
        raise ModelLoadError(
            f"{key}: {index} is not a valid weight index (JSON with a weight_map of tensor -> "
            f"file): {type(err).__name__}"
        ) from err
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise ModelLoadError(f"{key}: {index} names {shown(shard)}, not a file name in {folder}")
        if not (folder / shard).exists():
            raise ModelLoadError(f"{key}: {folder / shard} is missing ({WEIGHTS_INDEX} names it)")
        check_regular(folder / shard, error=keyed(key))
    return [folder / shard for shard in shards]


def weight_shapes(folder: Path, key: str = "model.name_or_path") -> dict[str, tuple[Path, list[int]]]:
    """Every tensor the folder's weight files hold: name -> (its file, its shape), from their checked headers."""
    found: dict[str, tuple[Path, list[int]]] = {}
    for path in weight_files(folder, key):
        found.update({name: (path, shape) for name, shape in safetensors_shapes(path, key).items()})
    return found


def check_tokenizer_files(folder: Path, key: str = "model.name_or_path") -> None:
    """The folder holds a tokenizer's files (one of TOKENIZER_FILES, or a ``*.tiktoken``)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise ModelLoadError(
            f"{key}: {folder} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} or *.tiktoken "
            "is there (copy the tokenizer's files from the model's hub repo)"
        )
