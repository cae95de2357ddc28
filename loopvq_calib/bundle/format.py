"""What writer and reader of a bundle share (format 1.x, docs/bundle-format.md): the file names, the format
versions (the newest, and the one a bundle's fields need), the error type, the rule for the names ``files`` may
list and how such a file is reached inside the bundle folder, strict JSON, the files' checksums and the one rule
that serialises ``loopvq.json`` with its own checksum."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..config.source import cut, shown
from ..runtime.files import sha256_file
from ..runtime.input_files import LongNumber, parse_json

FIELD_CHARS = 120  # the longest field path a message shows (paths hold names read from a file)
FORMAT_VERSION = "1.2"  # the newest format version this toolkit reads and writes
BASE_VERSION = "1.1"  # what a bundle that uses no 1.2 field is written as (every bundle carries 1.1's meta_sha256)
META_FILE = "loopvq.json"
TENSOR_FILE = "codebooks.safetensors"
CARD_FILE = "README.md"
_META_SUM = re.compile(rb'"meta_sha256"\s*:\s*"([0-9a-f]{64})"')
_GLOB = frozenset("*?[]")
MAX_NAME_BYTES, MAX_PART_BYTES = 1024, 255  # a listed name, and each of its components (the file system's NAME_MAX)


class BundleError(ValueError):
    """A bundle cannot be written or is invalid; the message names the file, tensor or field."""


def file_entry(path: Path) -> dict[str, Any]:
    """sha256 and size of a bundle file, as recorded under ``files`` in ``loopvq.json``."""
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def written_version(blocks: list[dict[str, Any]]) -> str:
    """The lowest minor version whose optional fields a bundle uses: 1.2 when a block has ``grouping``, else 1.1."""
    return FORMAT_VERSION if any("grouping" in b for b in blocks) else BASE_VERSION


def meta_checksum(data: bytes) -> str | None:
    """The ``meta_sha256`` a ``loopvq.json`` should carry: sha256 of its bytes with the field's 64 hex digits
    replaced by 64 ``0`` characters (None when the field is not there exactly once)."""
    found = list(_META_SUM.finditer(data))
    if len(found) != 1:
        return None
    return hashlib.sha256(data[: found[0].start(1)] + b"0" * 64 + data[found[0].end(1) :]).hexdigest()


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


# -- strict JSON ---------------------------------------------------------------------------------------
class _NonFinite(str):
    """A bare ``NaN`` / ``Infinity`` / ``-Infinity`` found while parsing (refused after the parse)."""


class _Object(dict):
    """A parsed JSON object that remembers the keys it held more than once."""

    duplicates: list[str]


def _pairs(items: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    obj.duplicates = []
    for key, value in items:
        if key in obj:
            obj.duplicates.append(key)
        obj[key] = value
    return obj


def _plain(value: Any, field: str, file: Path) -> Any:
    """``value`` as plain dicts and lists; a duplicate key, a non-finite number or one too long to convert
    (:class:`~loopvq_calib.runtime.input_files.LongNumber`) is a BundleError naming it."""
    if isinstance(value, LongNumber):
        raise BundleError(f"{file}: field {cut(field, FIELD_CHARS) or '(top level)'} is {value.describe()}")
    if isinstance(value, _NonFinite):
        raise BundleError(
            f"{file}: field {cut(field, FIELD_CHARS) or '(top level)'} is a bare {value}, which is not "
            'JSON (a writer stores non-finite numbers as the strings "nan", "inf", "-inf")'
        )
    if isinstance(value, _Object):
        if value.duplicates:
            name = f"{field}.{value.duplicates[0]}" if field else value.duplicates[0]
            raise BundleError(f"{file}: field {cut(name, FIELD_CHARS)} appears more than once (duplicate JSON key)")
        return {k: _plain(v, f"{field}.{k}" if field else k, file) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, f"{field}[{i}]", file) for i, v in enumerate(value)]
    return value


def strict_json(data: bytes, file: Path) -> Any:
    """Parse UTF-8 JSON strictly: a duplicate key, a bare ``NaN`` or ``Infinity``, a number too long to convert
    (:func:`~loopvq_calib.runtime.input_files.parse_json`) or malformed text is a BundleError naming ``file`` and the
    field."""
    try:
        parsed = parse_json(data.decode("utf-8"), object_pairs_hook=_pairs, parse_constant=_NonFinite)
        return _plain(parsed, "", file)
    except RecursionError:
        raise BundleError(f"{file}: nested too deeply to read (not valid JSON of this format)") from None
    except BundleError:
        raise
    except ValueError as err:  # malformed text, bad UTF-8
        raise BundleError(f"{file}: not valid JSON ({cut(str(err), 200)})") from err


# -- the files a bundle lists ----------------------------------------------------------------------------
def file_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be listed under ``files`` (None when it can): a relative POSIX path whose
    components are neither empty, ``.`` nor ``..``, without backslashes, glob characters (``* ? [ ]``) or
    control characters, of at most MAX_NAME_BYTES UTF-8 bytes and MAX_PART_BYTES a component."""
    if not isinstance(name, str) or not name:
        return "is not a non-empty string"
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode text (a lone surrogate)"
    if len(raw) > MAX_NAME_BYTES or max(map(len, raw.split(b"/"))) > MAX_PART_BYTES:
        return f"is longer than a file name may be ({MAX_NAME_BYTES} bytes, {MAX_PART_BYTES} a component)"
    if name.startswith("/"):
        return "is an absolute path"
    if "\\" in name:
        return "contains a backslash (paths use '/')"
    if _GLOB & set(name):
        return "contains a glob character (* ? [ ])"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "contains a control character"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "has an empty, '.' or '..' component"
    return None


def hub_blobs(root: Path) -> Path | None:
    """The blob folder of a hub-cache snapshot ``<cache>/models--org--name/snapshots/<commit>`` (its files are
    symlinks into it), or None for any other folder."""
    root = root.absolute()
    repo = root.parent.parent
    blobs = repo / "blobs"
    if root.parent.name == "snapshots" and repo.name.startswith("models--") and blobs.is_dir():
        return blobs if not blobs.is_symlink() else None
    return None


def bundle_file(root: Path, name: str, *, blobs: Path | None = None) -> Path:
    """``root / name`` when ``name`` obeys :func:`file_name_problem` and is a regular file inside ``root``
    reached through no symlink; in a hub-cache snapshot (``blobs``: :func:`hub_blobs`) its last component may
    be a symlink to a regular file directly in ``blobs``. Anything else is a BundleError naming the entry."""
    problem = file_name_problem(name)
    if problem is not None:
        raise BundleError(f"{root / META_FILE}: files entry {shown(name)} {problem}")
    parts = name.split("/")
    path = root
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            raise BundleError(f"{path}: missing (listed in {META_FILE})") from None
        except OSError as err:  # a name the file system refuses, a folder it may not read
            raise BundleError(
                f"{root / META_FILE}: files entry {shown(name)} cannot be looked up "
                f"({err.strerror or type(err).__name__})"
            ) from None
        last = i == len(parts) - 1
        if stat.S_ISLNK(mode):
            target = path.resolve()
            if not last or blobs is None or target.parent != blobs.resolve():
                raise BundleError(
                    f"{path}: files entry {shown(name)} is or passes through a symbolic link (a bundle's "
                    "files are regular files inside its folder)"
                )
            mode = target.stat().st_mode
        if not last and not stat.S_ISDIR(mode):
            raise BundleError(f"{path}: files entry {shown(name)} passes through something that is not a folder")
    if not stat.S_ISREG(mode):
        raise BundleError(f"{path}: files entry {shown(name)} is not a regular file")
    return path


def read_bundle_file(root: Path, name: str) -> bytes:
    """The bytes of ``root / name`` (checked by :func:`bundle_file`, no symlink allowed), opened without
    following a symlink put there since the check."""
    path = bundle_file(root, name)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:  # replaced by a symlink since the check (ELOOP), or removed
        raise BundleError(
            f"{path}: files entry {shown(name)} cannot be opened as a regular file ({err.strerror or err})"
        ) from err
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise BundleError(f"{path}: files entry {shown(name)} is not a regular file")
        return f.read()
