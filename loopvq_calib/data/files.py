"""Reading local corpus files (text, JSON lines, JSON arrays, parquet) directly, never through a cache, each a
regular file opened through runtime/input_files.py (a FIFO or a device is refused, never waited on).

Text and JSON lines are streamed line by line (a large file is read only as far as the calibration pool
needs); every line is decoded as strict UTF-8, so a bad byte is reported with its file, byte offset and line.
One line, paragraph or text document is read to at most DOCUMENT_BYTES (64 MiB): a longer text one is cut there
(its rest skipped unread), a longer JSON line is refused; a JSON array file is parsed whole, so it may hold at
most 256 MiB. A text value holding a lone surrogate (``"\\ud800"`` in JSON: not Unicode text) is refused naming
its file and row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ..config.schema import DataConfig
from ..config.source import shown
from ..runtime.input_files import DOCUMENT_BYTES, LIMITS, capped_lines, open_regular


class DataError(ValueError):
    """The calibration data cannot be loaded or is too small; names the config key."""


def file_documents(file: Path, kind: str, cfg: DataConfig, *, dataset_key: str, field_key: str) -> Iterator[Any]:
    """Non-empty documents of one local file of ``kind`` (text | json | parquet); errors name ``dataset_key``
    (or ``field_key`` for a missing column) and the file. With ``cfg.chat_template`` the column's values are
    yielded as they are (conversations, rendered by :func:`loopvq_calib.data.corpus.render_conversations`)."""
    if kind == "text" and cfg.chat_template:
        raise DataError(
            f"data.chat_template: {file} is a plain text file; conversations need json, jsonl or parquet rows"
        )
    if kind == "text":
        yield from _text_documents(file, cfg.text_sample_by, dataset_key)
        return
    if kind == "parquet":
        rows: Iterator[Any] = iter(_parquet_column(file, cfg.text_field, dataset_key, field_key=field_key))
    else:
        rows = _json_column(file, cfg.text_field, dataset_key, field_key=field_key)
    for text in rows:
        if cfg.chat_template or (isinstance(text, str) and text.strip()):
            yield text


def _open(file: Path, dataset_key: str) -> BinaryIO:
    return open_regular(file, error=lambda problem: DataError(f"{dataset_key}: {problem}"))


def _lines(file: Path, dataset_key: str, *, cut_long: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), strictly UTF-8 (a leading byte-order mark is dropped); a line
    longer than DOCUMENT_BYTES is read that far, its rest skipped (``cut_long``) or the line refused."""
    offset = 0
    try:
        with _open(file, dataset_key) as f:
            for number, (raw, length) in enumerate(capped_lines(f, DOCUMENT_BYTES), 1):
                if length > len(raw) and not cut_long:
                    raise DataError(
                        f"{dataset_key}: {file} line {number} holds {length:,} bytes, more than one row "
                        f"may hold ({DOCUMENT_BYTES:,}); split it into several rows"
                    )
                line = _decoded(raw, file, dataset_key, offset=offset, row=f"line {number}", cut=length > len(raw))
                offset += length
                yield number, (line.lstrip("\ufeff") if number == 1 else line).rstrip("\r\n")
    except OSError as err:
        raise DataError(f"{dataset_key}: cannot read {file}: {err.strerror}") from err


def _decoded(raw: bytes, file: Path, dataset_key: str, *, offset: int, row: str, cut: bool) -> str:
    """``raw`` as strict UTF-8 (``cut``: it was cut short, so a character cut in two at its end is dropped)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if cut and err.reason == "unexpected end of data" and err.start >= len(raw) - 3:
            return raw[: err.start].decode("utf-8")
        raise DataError(
            f"{dataset_key}: {file} is not UTF-8 text: byte offset {offset + err.start} ({row}: "
            f"{raw[err.start : err.start + 4]!r}...); convert it, e.g. iconv -f latin1 -t utf-8"
        ) from err


def _read_text(file: Path, dataset_key: str, *, whole: bool) -> str:
    """The file's text; ``whole``: all of it, at most the JSON-corpus bound (else refused), else its first
    DOCUMENT_BYTES (a text document cut there)."""
    limit = LIMITS["JSON corpus file"] if whole else DOCUMENT_BYTES
    try:
        with _open(file, dataset_key) as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise DataError(f"{dataset_key}: cannot read {file}: {err.strerror}") from err
    if whole and len(data) > limit:
        raise DataError(
            f"{dataset_key}: {file} holds more than {limit:,} bytes, the most a JSON array file may "
            "hold (it is parsed whole); write it as JSON lines (.jsonl), which are read row by row"
        )
    text = _decoded(data[:limit], file, dataset_key, offset=0, row="in the file", cut=len(data) > limit)
    return text.lstrip("\ufeff")


def _unicode_problem(value: Any) -> bool:
    """Whether a row's value holds a string that is not Unicode text (a lone surrogate, from a JSON escape)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_unicode_problem(v) for v in value.values())
    return isinstance(value, list) and any(_unicode_problem(v) for v in value)


def _text_documents(file: Path, sample_by: str, dataset_key: str) -> Iterator[str]:
    """A text file per line, per paragraph (blank-line separated) or as one document."""
    if sample_by == "document":
        text = _read_text(file, dataset_key, whole=False)
        if text.strip():
            yield text
        return
    paragraph: list[str] = []
    held = 0  # characters in ``paragraph``: past DOCUMENT_BYTES its further lines are dropped
    for _, line in _lines(file, dataset_key):
        if sample_by == "line":
            if line.strip():
                yield line
        elif line:
            if held < DOCUMENT_BYTES:
                paragraph.append(line)
                held += len(line) + 1
        elif paragraph:
            yield from _nonempty("\n".join(paragraph))
            paragraph, held = [], 0
    if paragraph:
        yield from _nonempty("\n".join(paragraph))


def _nonempty(text: str) -> Iterator[str]:
    if text.strip():
        yield text


def _json_column(file: Path, column: str, dataset_key: str, *, field_key: str) -> Iterator[Any]:
    """``column`` of each object of a JSON array (read whole) or of JSON lines (streamed)."""
    first = _first_char(file, dataset_key)
    if not first:
        return
    if first == b"[":
        text = _read_text(file, dataset_key, whole=True)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{dataset_key}: {file} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}"
            ) from err
        except RecursionError:
            raise DataError(f"{dataset_key}: {file} is nested too deeply to read") from None
        items = rows if isinstance(rows, list) else [rows]
        numbered: Iterator[tuple[str, Any]] = ((f"item {i}", row) for i, row in enumerate(items))
    else:
        numbered = (
            (f"line {n}", _json_line(file, n, line, dataset_key=dataset_key))
            for n, line in _lines(file, dataset_key, cut_long=False)
            if line.strip()
        )
    found, columns = False, None
    for where, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{dataset_key}: {file} {where}: expected a JSON object with a {shown(column)} field")
        if column in row:
            found = True
            if _unicode_problem(row[column]):
                raise DataError(
                    f"{dataset_key}: {file} {where}: field {shown(column)} holds a lone surrogate (a "
                    "\\ud800-\\udfff escape not part of a pair), which is not Unicode text; fix that row"
                )
            yield row[column]
        elif columns is None:
            columns = sorted(row)
    if not found and columns is not None:
        raise DataError(f"{field_key}: column {shown(column)} not in {file} (columns: {shown(columns)})")


def _first_char(file: Path, dataset_key: str) -> bytes:
    """The first byte of the file that is not whitespace (nor a byte-order mark); empty when there is none."""
    try:
        with _open(file, dataset_key) as f:
            for chunk in iter(lambda: f.read(1 << 16), b""):
                rest = chunk.removeprefix(b"\xef\xbb\xbf") if f.tell() == len(chunk) else chunk
                if rest.strip():
                    return rest.lstrip()[:1]
    except OSError as err:
        raise DataError(f"{dataset_key}: cannot read {file}: {err.strerror}") from err
    return b""


def _json_line(file: Path, number: int, line: str, *, dataset_key: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{dataset_key}: {file} line {number} is not a JSON object ({err.msg}, column {err.colno})"
        ) from err
    except RecursionError:
        raise DataError(f"{dataset_key}: {file} line {number} is nested too deeply to read") from None


def _parquet_column(file: Path, column: str, dataset_key: str, *, field_key: str) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(file)
    except Exception as err:  # pyarrow raises its own types for truncated or foreign files
        raise DataError(
            f"{dataset_key}: {file} is not a readable parquet file ({type(err).__name__}: {str(err)[:200]})"
        ) from err
    if column not in schema.names:
        raise DataError(f"{field_key}: column {shown(column)} not in {file} (columns: {shown(schema.names)})")
    try:
        return pq.read_table(file, columns=[column]).column(column).to_pylist()
    except Exception as err:
        raise DataError(f"{dataset_key}: {file} is not a readable parquet file ({type(err).__name__}: {err})") from err
