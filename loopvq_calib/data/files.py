"""Reading local corpus files (text, JSON lines, JSON arrays, parquet) directly, never through a cache.

Text and JSON lines are streamed line by line (a large file is read only as far as the calibration pool
needs); every line is decoded as strict UTF-8, so a bad byte is reported with its file and byte offset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from ..config.schema import DataConfig
from ..config.source import shown


class DataError(ValueError):
    """The calibration data cannot be loaded or is too small; names the config key."""


def file_documents(file: Path, kind: str, cfg: DataConfig, *, dataset_key: str, field_key: str) -> Iterator[Any]:
    """Non-empty documents of one local file of ``kind`` (text | json | parquet); errors name ``dataset_key``
    (or ``field_key`` for a missing column) and the file. With ``cfg.chat_template`` the column's values are
    yielded as they are (conversations, rendered by :func:`loopvq_calib.data.corpus.render_conversations`)."""
    if kind == "text" and cfg.chat_template:
        raise DataError(f"data.chat_template: {file} is a plain text file; conversations need json, jsonl or "
                        "parquet rows")
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


def _lines(file: Path, dataset_key: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), strictly UTF-8 (a leading byte-order mark is dropped)."""
    offset = 0
    try:
        with open(file, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise _not_utf8(file, dataset_key, offset + err.start, bad=raw[err.start:err.start + 4]) from err
                offset += len(raw)
                yield number, (line.lstrip("\ufeff") if number == 1 else line).rstrip("\r\n")
    except OSError as err:
        raise DataError(f"{dataset_key}: cannot read {file}: {err.strerror}") from err


def _not_utf8(file: Path, dataset_key: str, offset: int, *, bad: bytes) -> DataError:
    return DataError(f"{dataset_key}: {file} is not UTF-8 text: byte offset {offset} ({bad!r}...); convert it, "
                     "e.g. iconv -f latin1 -t utf-8")


def _read_text(file: Path, dataset_key: str) -> str:
    try:
        data = file.read_bytes()
    except OSError as err:
        raise DataError(f"{dataset_key}: cannot read {file}: {err.strerror}") from err
    try:
        return data.decode("utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as err:
        raise _not_utf8(file, dataset_key, err.start, bad=data[err.start:err.start + 4]) from err


def _text_documents(file: Path, sample_by: str, dataset_key: str) -> Iterator[str]:
    """A text file per line, per paragraph (blank-line separated) or as one document."""
    if sample_by == "document":
        text = _read_text(file, dataset_key)
        if text.strip():
            yield text
        return
    paragraph: list[str] = []
    for _, line in _lines(file, dataset_key):
        if sample_by == "line":
            if line.strip():
                yield line
        elif line:
            paragraph.append(line)
        elif paragraph:
            yield from _nonempty("\n".join(paragraph))
            paragraph = []
    if paragraph:
        yield from _nonempty("\n".join(paragraph))


def _nonempty(text: str) -> Iterator[str]:
    if text.strip():
        yield text


def _json_column(file: Path, column: str, dataset_key: str, *, field_key: str) -> Iterator[Any]:
    """``column`` of each object of a JSON array (read whole) or of JSON lines (streamed)."""
    lines = _lines(file, dataset_key)
    first = next(((n, line) for n, line in lines if line.strip()), None)
    if first is None:
        return
    if first[1].lstrip().startswith("["):
        text = _read_text(file, dataset_key)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataError(f"{dataset_key}: {file} is not valid JSON: {err.msg} at line {err.lineno} column "
                            f"{err.colno}") from err
        except RecursionError:
            raise DataError(f"{dataset_key}: {file} is nested too deeply to read") from None
        items = rows if isinstance(rows, list) else [rows]
        numbered: Iterator[tuple[str, Any]] = ((f"item {i}", row) for i, row in enumerate(items))
    else:
        numbered = ((f"line {n}", _json_line(file, n, line, dataset_key=dataset_key))
                    for n, line in _chain(first, lines) if line.strip())
    found, columns = False, None
    for where, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{dataset_key}: {file} {where}: expected a JSON object with a {shown(column)} field")
        if column in row:
            found = True
            yield row[column]
        elif columns is None:
            columns = sorted(row)
    if not found and columns is not None:
        raise DataError(f"{field_key}: column {shown(column)} not in {file} (columns: {shown(columns)})")


def _chain(first: tuple[int, str], rest: Iterator[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    yield first
    yield from rest


def _json_line(file: Path, number: int, line: str, *, dataset_key: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{dataset_key}: {file} line {number} is not a JSON object ({err.msg}, column "
                        f"{err.colno})") from err
    except RecursionError:
        raise DataError(f"{dataset_key}: {file} line {number} is nested too deeply to read") from None


def _parquet_column(file: Path, column: str, dataset_key: str, *, field_key: str) -> list[Any]:
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(file)
    except Exception as err:  # pyarrow raises its own types for truncated or foreign files
        raise DataError(f"{dataset_key}: {file} is not a readable parquet file ({type(err).__name__}: "
                        f"{str(err)[:200]})") from err
    if column not in schema.names:
        raise DataError(f"{field_key}: column {shown(column)} not in {file} (columns: {shown(schema.names)})")
    try:
        return pq.read_table(file, columns=[column]).column(column).to_pylist()
    except Exception as err:
        raise DataError(f"{dataset_key}: {file} is not a readable parquet file ({type(err).__name__}: {err})") from err
