"""What writer and reader of a bundle share (format 1.x, docs/bundle-format.md): the file names, the format
version, the files' checksums and the one rule that serialises ``loopvq.json`` with its own checksum."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from ..runtime.files import sha256_file

FORMAT_VERSION = "1.1"
META_FILE = "loopvq.json"
TENSOR_FILE = "codebooks.safetensors"
CARD_FILE = "README.md"
_META_SUM = re.compile(rb'"meta_sha256"\s*:\s*"([0-9a-f]{64})"')


def file_entry(path: Path) -> dict[str, Any]:
    """sha256 and size of a bundle file, as recorded under ``files`` in ``loopvq.json``."""
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def meta_checksum(data: bytes) -> str | None:
    """The ``meta_sha256`` a ``loopvq.json`` should carry: sha256 of its bytes with the field's 64 hex digits
    replaced by 64 ``0`` characters (None when the field is not there exactly once)."""
    found = list(_META_SUM.finditer(data))
    if len(found) != 1:
        return None
    return hashlib.sha256(data[:found[0].start(1)] + b"0" * 64 + data[found[0].end(1):]).hexdigest()


def meta_bytes(meta: dict[str, Any]) -> bytes:
    """``loopvq.json`` with its ``meta_sha256`` (sha256 of these bytes with the value as 64 zeros)."""
    meta = {**meta, "meta_sha256": "0" * 64}
    data = (json.dumps(json_safe(meta), indent=1, allow_nan=False) + "\n").encode("utf-8")
    digest = meta_checksum(data)
    return data.replace(b'"meta_sha256": "' + b"0" * 64 + b'"', b'"meta_sha256": "' + digest.encode() + b'"')


def json_safe(obj: Any) -> Any:
    """Strict JSON: tensors/numpy scalars as numbers, non-finite floats as the strings "nan"/"inf"/"-inf"."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)
