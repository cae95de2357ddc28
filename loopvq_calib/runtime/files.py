"""Files written safely: through a temporary sibling and a rename (never half a file in place), and hashed
in chunks. The one atomic-write helper of the toolkit (run directories, bundles, model cards, fine-tuning's
epoch state)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

TMP_PREFIX = ".loopvq-tmp."  # temporary entries: no other program uses such names


def sha256_file(path: Path | str) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def temp_sibling(final: Path) -> Path:
    """The temporary file beside ``final`` through which this process writes it."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")


def remove_temp_siblings(final: Path) -> None:
    """Delete the temporary files beside ``final`` that writes of it left (any process's: a killed run's)."""
    for orphan in final.parent.glob(f"{glob.escape(TMP_PREFIX + final.name)}.*"):
        orphan.unlink(missing_ok=True)


def write_temp_with(final: Path, write: Callable[[Path], None], durable: bool = False) -> Path:
    """The file that ``write(path)`` writes at the temporary sibling of ``final`` (``durable``: then flushed to
    the disk), removed if writing fails -> its path, for a rename into place."""
    tmp = temp_sibling(final)
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_temp(final: Path, data: bytes, durable: bool = False) -> Path:
    """``data`` written into the temporary sibling of ``final`` (:func:`write_temp_with`) -> its path."""
    return write_temp_with(final, lambda tmp: tmp.write_bytes(data), durable)


def write_atomic(path: Path, write: Callable[[Path], None], durable: bool = False) -> None:
    """Replace ``path`` by the file that ``write(temporary path)`` writes, renamed into place once whole (never a
    half-written file, nor a temporary one left behind when writing or renaming fails)."""
    tmp = write_temp_with(path, write, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> None:
    """Write ``data`` to ``path`` through :func:`write_atomic`."""
    write_atomic(path, lambda tmp: tmp.write_bytes(data), durable)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary sibling and a rename (never a half-written file)."""
    write_bytes_atomic(path, json.dumps(obj, indent=1, default=str).encode())
