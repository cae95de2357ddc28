"""Calibration corpora: load documents, concatenate with the tokenizer's separator, cut into sequences.

Windows are non-overlapping ``sequence_length``-token slices of the concatenated stream (documents in
order, each followed by the separator), drawn from its first ``POOL_FACTOR * num_sequences *
sequence_length`` tokens; ``seed`` picks which windows and which of them are held out. A document longer than
PIECE_CHARS characters is tokenized a piece at a time, and only as far as that pool needs.
"""

from __future__ import annotations

import glob
import hashlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from ..config.schema import DataConfig
from ..config.source import LOCAL_TYPES, first_line, shown
from ..models.loading import hub_offline
from ..runtime.files import sha256_file
from ..runtime.input_files import check_regular
from .files import DataError, file_documents

POOL_FACTOR = 16
PIECE_CHARS = 1 << 20  # a longer document is tokenized a piece of about this many characters at a time


@dataclass
class CalibrationSet:
    """Token ids [n, L] plus which sequences train and which pick the fine-tuning epoch."""

    input_ids: torch.Tensor
    train: list[int]
    heldout: list[int]
    sink_tokens: int
    description: dict[str, Any] = field(default_factory=dict)

    @property
    def content_hash(self) -> str:
        """sha256 of the token ids and the split (what the data stage's record names)."""
        ids = self.input_ids.to(torch.int64).contiguous().numpy().tobytes()
        split = f"{self.train}|{self.heldout}|{self.sink_tokens}".encode()
        return hashlib.sha256(ids + split).hexdigest()


def local_files(spec: str, key: str = "data.dataset") -> list[str]:
    """The local files ``spec`` (file, folder or glob) names, sorted; empty when it names none. A name the file
    system refuses (too long), a folder it may not read, or a folder's or glob's entry that is not a regular file
    (a FIFO, a link to a device: runtime/input_files.py) is a DataError naming ``key``."""
    path = Path(spec)
    try:
        if path.is_dir():
            found = sorted(str(p) for p in path.iterdir() if p.suffix in LOCAL_TYPES)
        elif any(ch in spec for ch in "*?["):
            found = sorted(glob.glob(spec))
        else:
            return [spec] if path.is_file() else []
    except OSError as err:
        raise DataError(f"{key}: cannot use {shown(spec)} ({err.strerror or type(err).__name__})") from None
    for file in found:
        check_regular(file, error=lambda problem: DataError(f"{key}: {problem}"))
    return found


def source_fingerprint(cfg: DataConfig) -> list[tuple[str, int, str]]:
    """(file name, size, sha256) of every local file ``data.dataset`` names (empty for a hub dataset), so an
    edited corpus invalidates the data stage of a run directory."""
    return [(os.path.basename(n), os.path.getsize(n), sha256_file(n)) for n in local_files(cfg.dataset)]


def _option(names: dict[str, str | None] | None, name: str) -> str | None:
    """How the user sets DataConfig field ``name`` (``data.<name>`` in a config; a CLI flag in loopvq-eval;
    None: not settable there)."""
    return (names or {}).get(name, f"data.{name}")


def load_documents(cfg: DataConfig, names: dict[str, str | None] | None = None) -> Iterator[Any]:
    """Yield the documents' text (with ``data.chat_template``: their conversations) from local files (text /
    json / jsonl / parquet, read directly: no cache outside the run directory, so an edited file is always read
    afresh) or a hub dataset (``datasets``, through the hub cache). ``names`` renames fields in error messages
    (see :func:`_option`)."""
    files = local_files(cfg.dataset, _option(names, "dataset"))
    kind = "json" if cfg.type == "jsonl" else cfg.type
    if files and kind in ("auto", "text", "json", "parquet"):
        if kind == "auto":
            kinds = {LOCAL_TYPES.get(Path(f).suffix) for f in files}
            if len(kinds) != 1 or None in kinds:
                how = f"; set {_option(names, 'type')}" if _option(names, "type") else ""
                raise DataError(
                    f"{_option(names, 'dataset')}: cannot infer the file type of {shown(files)} (known "
                    f"suffixes: {', '.join(LOCAL_TYPES)}){how}"
                )
            kind = kinds.pop()

        field_key = _option(names, "text_field") or _option(names, "dataset")
        for file in files:
            yield from file_documents(Path(file), kind, cfg, dataset_key=_option(names, "dataset"), field_key=field_key)
        return
    if kind in ("auto", "hub") and not files and not _looks_like_a_path(cfg.dataset):
        yield from _hub_documents(cfg, names)
        return
    if Path(cfg.dataset).is_dir():
        raise DataError(f"{_option(names, 'dataset')}: folder {cfg.dataset} holds no {', '.join(LOCAL_TYPES)} file")
    raise DataError(f"{_option(names, 'dataset')}: no local file matches {shown(cfg.dataset)} (type {cfg.type})")


def _looks_like_a_path(spec: str) -> bool:
    return (
        os.path.isabs(spec)
        or spec.startswith((".", "~"))
        or spec.endswith(tuple(LOCAL_TYPES))
        or any(ch in spec for ch in "*?[")
    )


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached (its name does not resolve, no connection within ``timeout``
    seconds), or None when it answers a connection. Asked before a hub dataset is loaded online, so that an offline
    machine gets one line at once rather than datasets' retries."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout).close()
    except OSError as err:
        return f"{url.scheme}://{url.netloc}: {err.strerror or type(err).__name__}"
    return None


def _hub_documents(cfg: DataConfig, names: dict[str, str | None] | None) -> Iterator[str]:
    import datasets

    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or hub_offline()
    unreachable = None if offline else hub_unreachable()
    if unreachable:
        key = _option(names, "dataset") or "data.dataset"
        local = f"{key} <file>" if key.startswith("-") else f"--set {key}=<file>"
        raise DataError(
            f"{key}: cannot load {shown(cfg.dataset)} from the hub, which cannot be reached "
            f"({unreachable}); give a local file or folder ({local}), or set HF_DATASETS_OFFLINE=1 to "
            "read it from the local cache"
        )
    try:
        ds = datasets.load_dataset(cfg.dataset, cfg.config_name, split=cfg.split)
    except Exception as err:  # offline, unknown name, missing split: all surface here
        hint = " (offline mode is on: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if offline else ""
        raise DataError(
            f"{_option(names, 'dataset')}: could not load {shown(cfg.dataset)} (config {shown(cfg.config_name)}, split "
            f"{shown(cfg.split)}) from the hub{hint}: {type(err).__name__}: {first_line(err)}"
        ) from err
    if cfg.text_field not in ds.column_names:
        key = _option(names, "text_field") or _option(names, "dataset")
        raise DataError(
            f"{key}: column {shown(cfg.text_field)} not in {shown(cfg.dataset)} (columns: {shown(ds.column_names)})"
        )
    for row in ds:
        text = row[cfg.text_field]
        if cfg.chat_template or (isinstance(text, str) and text.strip()):
            yield text


def checked_conversations(rows: Iterator[Any], field_key: str) -> Iterator[list[dict[str, Any]]]:
    """The rows, each checked to be a conversation (a non-empty list of ``{"role", "content"}`` messages)."""
    for n, messages in enumerate(rows):
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
        ):
            raise DataError(
                f"{field_key}: with data.chat_template every row must be a non-empty list of "
                f"{{role, content}} messages; document {n} is {type(messages).__name__} "
                f"{shown(messages, 60)}"
            )
        yield messages


def render_conversations(conversations: Iterator[list[dict[str, Any]]], tokenizer: Any) -> Iterator[str]:
    """Each conversation as the text the model sees in chat use: the tokenizer's chat template, without a
    generation prompt (``data.chat_template``). Rendered one at a time, as they are consumed."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.chat_template: the tokenizer of model.name_or_path has no chat template "
            "(tokenizer_config.json has no chat_template)"
        )
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        if text.strip():
            yield text


def _pieces(doc: str) -> Iterator[str]:
    """``doc`` whole when it has at most PIECE_CHARS characters; else pieces of about that many, each cut before
    a space or newline in its second half (where one is), so that words stay whole."""
    start = 0
    while len(doc) - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        space = max(doc.rfind(" ", start + PIECE_CHARS // 2, end), doc.rfind("\n", start + PIECE_CHARS // 2, end))
        end = space if space > start else end
        yield doc[start:end]
        start = end
    yield doc[start:]


def _token_stream(docs: Iterator[str], tokenizer: Any, limit: int) -> tuple[list[int], int]:
    """Token ids of the documents (each followed by the separator) until ``limit``; a long document is tokenized
    a piece at a time (:func:`_pieces`), only as far as ``limit`` needs."""
    sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.bos_token_id
    if sep is None:
        raise DataError("model.name_or_path: the tokenizer has no eos or bos token to separate documents")
    ids: list[int] = []
    count = 0
    for doc in docs:
        for piece in _pieces(doc):
            ids.extend(tokenizer(piece, add_special_tokens=False, verbose=False)["input_ids"])
            if len(ids) >= limit:
                break
        ids.append(sep)
        count += 1
        if len(ids) >= limit:
            break
    return ids, count


def build_calibration_set(
    cfg: DataConfig, tokenizer: Any, names: dict[str, str | None] | None = None
) -> CalibrationSet:
    """Deterministic (given ``cfg.seed``) calibration sequences and their train / held-out split."""
    n, length = cfg.num_sequences, cfg.sequence_length
    source = load_documents(cfg, names)
    texts = source
    if cfg.chat_template:
        source = checked_conversations(source, _option(names, "text_field") or "data.text_field")
        texts = render_conversations(source, tokenizer)
    ids, docs = _token_stream(texts, tokenizer, POOL_FACTOR * n * length)
    # read (not tokenize or render) the rest: a bad row anywhere fails before the run
    if local_files(cfg.dataset, _option(names, "dataset")):
        for _ in source:
            pass
    if docs == 0:
        raise DataError(
            f"{_option(names, 'dataset')}: {cfg.dataset} holds no text (no non-empty "
            f"{shown(cfg.text_field)} in any document)"
        )
    windows = len(ids) // length
    if windows < n:
        raise DataError(
            f"{_option(names, 'num_sequences')}: {cfg.dataset} gives {len(ids):,} tokens ({docs} documents), "
            f"only {windows} windows of {length} tokens ({_option(names, 'sequence_length')}); {n} were asked for"
        )
    gen = torch.Generator().manual_seed(cfg.seed)
    chosen = torch.randperm(windows, generator=gen)[:n].sort().values
    stream = torch.tensor(ids[: windows * length], dtype=torch.long).view(windows, length)
    order = torch.randperm(n, generator=gen).tolist()
    heldout = sorted(order[: cfg.heldout_sequences])
    train = sorted(order[cfg.heldout_sequences :])
    return CalibrationSet(
        input_ids=stream[chosen].clone(),
        train=train,
        heldout=heldout,
        sink_tokens=cfg.sink_tokens,
        description={
            "dataset": cfg.dataset,
            "config_name": cfg.config_name,
            "split": cfg.split,
            "text_field": cfg.text_field,
            "chat_template": cfg.chat_template,
            "documents_read": docs,
            "tokens_in_pool": len(ids),
            "num_sequences": n,
            "sequence_length": length,
            "seed": cfg.seed,
        },
    )
