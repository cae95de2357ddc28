"""Files written safely: through a temporary sibling and a rename (never half a file in place), and hashed
in chunks. The one atomic-write helper of the toolkit (run directories, bundles, model cards)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

TMP_PREFIX = ".loopvq-tmp."  # temporary entries: no other program uses such names


def sha256_file(path: Path | str) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_temp(final: Path, data: bytes, durable: bool = False) -> Path:
    """``data`` written into a temporary sibling of ``final`` (``durable``: flushed to the disk too), removed
    if writing fails -> its path, for a rename into place."""
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> None:
    """Write ``data`` through a temporary sibling and a rename (never a half-written file, nor a temporary
    one left behind)."""
    tmp = write_temp(path, data, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary sibling and a rename (never a half-written file)."""
    write_bytes_atomic(path, json.dumps(obj, indent=1, default=str).encode())
