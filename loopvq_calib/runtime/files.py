"""Files written safely: through a temporary sibling and a rename (never half a file in place), hashed as they are
written. The one atomic-write helper of the toolkit (run directories, bundles, model cards, fine-tuning's epoch
state, the stages' files).

A folder can ask for the digests of the files written under it (:func:`recording_digests`): every write through
:func:`write_stream_atomic` (and the helpers built on it) below such a folder appends the file's sha256 and size,
computed from the bytes as they were written, to the folder's ``.loopvq-digests`` log, from any thread or process
(:func:`take_digests` reads it), so nobody has to read a finished file back to learn its hash.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

TMP_PREFIX = ".loopvq-tmp."  # temporary entries: no other program uses such names
DIGEST_LOG = ".loopvq-digests"  # in a folder recording digests: one JSON line per file written under it
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
# safetensors lays tensors out by dtype in this order (its dtype enum, largest first), then by name
_SAFETENSORS_ORDER = (
    "U64",
    "I64",
    "F64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)
_RECORDING: dict[str, int] = {}  # absolute folder -> how many open recording_digests blocks name it
_RECORDING_LOCK = threading.Lock()


class HashingWriter:
    """A binary file that hashes what is written to it: ``sha256`` and ``size`` of the bytes so far."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        """Write (and hash) a bytes-like object; returns its length in bytes."""
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.file.write(view)
        self.size += view.nbytes
        return view.nbytes


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


def remove_temp_siblings(*finals: Path) -> None:
    """Delete the temporary files beside each of ``finals`` that writes of it left (any process's: a killed
    run's); each folder is listed once, however many of its files are named."""
    by_folder: dict[Path, set[str]] = {}
    for final in finals:
        by_folder.setdefault(final.parent, set()).add(final.name)
    for folder, names in by_folder.items():
        for orphan in folder.glob(f"{glob.escape(TMP_PREFIX)}*.*"):
            if orphan.name[len(TMP_PREFIX) :].rpartition(".")[0] in names:  # temp_sibling: PREFIX + name + .pid
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
    half-written file, nor a temporary one left behind when writing or renaming fails). Its digest is not
    recorded (the writer, not this helper, holds the bytes): stage files go through :func:`write_stream_atomic`."""
    tmp = write_temp_with(path, write, durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_stream_atomic(path: Path, write: Callable[[HashingWriter], None], durable: bool = False) -> str:
    """Replace ``path`` (as :func:`write_atomic`) by what ``write(stream)`` writes into a :class:`HashingWriter`;
    the digest is logged when a folder above ``path`` records digests -> the sha256 (hex) of the bytes written."""
    hashed: list[HashingWriter] = []

    def to_file(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            hashed.append(HashingWriter(f))
            write(hashed[0])

    write_atomic(path, to_file, durable)
    digest = hashed[0].sha256.hexdigest()
    _log_digest(Path(path), digest, hashed[0].size)
    return digest


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> str:
    """Write ``data`` to ``path`` through :func:`write_stream_atomic` -> its sha256."""
    return write_stream_atomic(path, lambda out: out.write(data), durable)


def write_json_atomic(path: Path, obj: Any) -> str:
    """Write JSON through a temporary sibling and a rename (never a half-written file) -> its sha256."""
    return write_bytes_atomic(path, json.dumps(obj, indent=1, default=str).encode())


def write_tensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """A safetensors file through :func:`write_stream_atomic` (:func:`write_safetensors`) -> its sha256."""
    return write_stream_atomic(path, lambda out: write_safetensors(out, tensors, metadata))


def write_safetensors(
    out: HashingWriter | BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> None:
    """``tensors`` in the safetensors format, laid out as ``safetensors.torch.save`` lays them out (by dtype, then
    name; the header padded to 8 bytes), each written from its own memory (no copy of a contiguous CPU tensor)."""
    unknown = sorted(k for k, t in tensors.items() if t.dtype not in SAFETENSORS_DTYPES)
    if unknown:
        raise ValueError(f"no safetensors dtype for {', '.join(unknown)} ({tensors[unknown[0]].dtype})")
    names = sorted(tensors, key=lambda k: (_SAFETENSORS_ORDER.index(SAFETENSORS_DTYPES[tensors[k].dtype]), k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata is not None else {}
    start = 0
    for name in names:
        t = tensors[name]
        end = start + t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    out.write(struct.pack("<Q", len(text)))
    out.write(text)
    for name in names:
        out.write(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


@contextmanager
def recording_digests(folder: Path) -> Iterator[None]:
    """Within the block, files this process writes under ``folder`` through :func:`write_stream_atomic` have their
    sha256 and size appended to ``folder/.loopvq-digests`` (after the rename that puts each in place)."""
    key = os.path.abspath(folder)
    with _RECORDING_LOCK:
        _RECORDING[key] = _RECORDING.get(key, 0) + 1
    try:
        yield
    finally:
        with _RECORDING_LOCK:
            _RECORDING[key] -= 1
            if not _RECORDING[key]:
                del _RECORDING[key]


def take_digests(folder: Path) -> dict[str, tuple[str, int]]:
    """The digests logged in ``folder`` (relative POSIX name -> (sha256, size); the last line of a file wins, a
    line a killed process cut short is skipped), and the log removed."""
    log = Path(folder) / DIGEST_LOG
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # none, or not a file of ours (a link): nothing recorded
        return {}
    with os.fdopen(fd, "rb") as f:
        lines = f.read().splitlines()
    log.unlink()
    digests = {}
    for line in lines:
        try:
            entry = json.loads(line)
            digests[str(entry["file"])] = (str(entry["sha256"]), int(entry["bytes"]))
        except (ValueError, TypeError, KeyError):
            continue
    return digests


def _log_digest(path: Path, digest: str, size: int) -> None:
    """Append ``path``'s digest to the log of every recording folder above it (one ``write``, O_APPEND: the lines
    of several processes never interleave)."""
    full = os.path.abspath(path)
    with _RECORDING_LOCK:
        folders = [folder for folder in _RECORDING if full.startswith(folder + os.sep)]
    for folder in folders:
        line = json.dumps({"file": Path(os.path.relpath(full, folder)).as_posix(), "sha256": digest, "bytes": size})
        fd = os.open(os.path.join(folder, DIGEST_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
