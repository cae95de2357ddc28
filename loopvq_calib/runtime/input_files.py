"""Input files read with a bound: the one reader of every file the toolkit takes from a user or a download (a
bundle's ``loopvq.json``, evaluation reports, a model folder's JSON, tokenizer files and safetensors headers,
corpora, a run directory's records).

A file is read only when it is a regular file: a symbolic link is followed to a regular file only, and a FIFO,
device, socket or folder is refused before it is opened for reading (so nothing waits on a pipe or reads
``/dev/zero`` forever). A file is read to at most the cap of its kind (:data:`LIMITS`), and JSON is parsed with
its numbers bounded before any conversion (:func:`parse_json`: an integer of more than :data:`MAX_INT_DIGITS`
digits, or a float that is not finite, becomes a :class:`LongNumber` the caller refuses naming its field).
Every refusal is raised as the caller's error (``error``: message -> exception), so a bundle's is a BundleError,
a model folder's a ModelLoadError: the console scripts exit 2.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

MiB = 1 << 20
# the most bytes one file of each kind may hold (a kind is named in the refusal)
LIMITS = {
    "bundle metadata file": 64 * MiB,  # loopvq.json (a 1M-entry sites list is about 8 MiB)
    "evaluation report": 64 * MiB,
    "model JSON file": 64 * MiB,  # config.json, the weight index, generation_config.json
    "tokenizer file": 1024 * MiB,  # tokenizer.json, *.model, merges and vocab files (hashed in chunks)
    "safetensors header": 100 * MiB,  # as the safetensors library itself allows
    "JSON corpus file": 256 * MiB,  # a JSON array is parsed whole (JSON lines are streamed)
    "run record": 64 * MiB,  # a run directory's manifest.json
}
DOCUMENT_BYTES = 64 * MiB  # the most one corpus line, paragraph or document is read of (the rest is skipped)
MAX_INT_DIGITS = 30  # digits of a JSON integer (2**64 has 20)
MAX_FLOAT_CHARS = 40  # characters of a JSON float's text
CHUNK = 1 << 20

ErrorFactory = Callable[[str], Exception]
_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _what(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path | str, *, error: ErrorFactory) -> os.stat_result:
    """``path``'s status when it is (or links to) a regular file; anything else, or a path that cannot be
    looked up, is ``error(message)``."""
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path} does not exist" + (" (a broken link)" if os.path.islink(path) else "")) from None
    except OSError as err:
        raise error(f"{path} cannot be read ({err.strerror or type(err).__name__})") from None
    if not stat.S_ISREG(status.st_mode):
        raise error(f"{path} is {_what(status.st_mode)}, not a regular file (only regular files are read)")
    return status


def open_regular(path: Path | str, *, error: ErrorFactory) -> BinaryIO:
    """``path`` opened for reading when it is a regular file (:func:`check_regular`), checked again on the open
    file (a FIFO swapped in since is opened without waiting for a writer, and refused)."""
    check_regular(path, error=error)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise error(f"{path} cannot be opened ({err.strerror or type(err).__name__})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path} is {_what(mode)}, not a regular file (only regular files are read)")
    if hasattr(os, "set_blocking"):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _too_large(path: Path | str, kind: str, limit: int) -> str:
    return f"{path} holds more than {limit:,} bytes, the most a {kind} may hold"


def read_capped(path: Path | str, kind: str, *, error: ErrorFactory) -> bytes:
    """The bytes of the regular file ``path``, which may hold at most ``LIMITS[kind]`` (never more is read)."""
    limit = LIMITS[kind]
    with open_regular(path, error=error) as f:
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise error(f"{path} cannot be read ({err.strerror or type(err).__name__})") from None
    if len(data) > limit:
        raise error(_too_large(path, kind, limit))
    return data


def chunks_capped(path: Path | str, kind: str, *, error: ErrorFactory) -> Iterator[bytes]:
    """The regular file ``path`` in chunks of 1 MiB (to hash it), refused past ``LIMITS[kind]`` bytes."""
    limit, total = LIMITS[kind], 0
    with open_regular(path, error=error) as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            total += len(chunk)
            if total > limit:
                raise error(_too_large(path, kind, limit))
            yield chunk


def capped_lines(file: BinaryIO, limit: int) -> Iterator[tuple[bytes, int]]:
    """The lines of a binary file (newline kept) as (at most ``limit`` bytes of the line, the line's whole length):
    a longer line's rest is read past in chunks, never held."""
    while True:
        line = file.readline(limit)
        if not line:
            return
        length = len(line)
        if length == limit and not line.endswith(b"\n"):
            while True:  # skip to the end of this line
                rest = file.readline(CHUNK)
                length += len(rest)
                if not rest or rest.endswith(b"\n"):
                    break
        yield line, length


# -- JSON with bounded numbers ------------------------------------------------------------------------------
class LongNumber(str):
    """A JSON number too long to convert (an integer of more than MAX_INT_DIGITS digits, a float's text longer
    than MAX_FLOAT_CHARS or not finite as a float), kept as its text for the caller to refuse by field."""

    def describe(self) -> str:
        """The number, shortened, and why it is refused."""
        head = self if len(self) <= 24 else f"{self[:12]}...{self[-6:]}"
        if any(c in self for c in ".eE"):
            return (
                f"the number {head}, which is no finite float of at most {MAX_FLOAT_CHARS} characters (too long "
                "or too large to read)"
            )
        return f"an integer of {len(self.lstrip('-')):,} digits ({head}); at most {MAX_INT_DIGITS} digits are read"


def _int(text: str) -> int | LongNumber:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else LongNumber(text)


def _float(text: str) -> float | LongNumber:
    if len(text) > MAX_FLOAT_CHARS:
        return LongNumber(text)
    value = float(text)
    return value if math.isfinite(value) else LongNumber(text)


def parse_json(text: str | bytes, **hooks: Any) -> Any:
    """``json.loads`` with bounded numbers (:class:`LongNumber` for those too long); ``hooks`` are json.loads's
    own (``object_pairs_hook``, ``parse_constant``)."""
    return json.loads(text, parse_int=_int, parse_float=_float, **hooks)


def long_number(value: Any, field: str = "") -> tuple[str, LongNumber] | None:
    """The first :class:`LongNumber` in a parsed JSON value and its field path (``a.b[2]``), or None."""
    stack: list[tuple[str, Any]] = [(field, value)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, LongNumber):
            return where or "(top level)", node
        if isinstance(node, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(node.items()))]
        elif isinstance(node, list):
            stack += [(f"{where}[{i}]", v) for i, v in reversed(list(enumerate(node)))]
    return None
