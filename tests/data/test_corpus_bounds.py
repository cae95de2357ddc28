"""Corpora are read and tokenized with a bound (docs/reliability.md, "Bounds"): a document longer than the
windows need is read only to DOCUMENT_BYTES and tokenized a piece at a time, only as far as the pool needs; a JSON
line or JSON array past its bound is refused naming it (the bounds are lowered here, so the files stay small)."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from conftest import REFERENCE_MODEL
from transformers import AutoTokenizer

from loopvq_calib.config.schema import DataConfig
from loopvq_calib.data import corpus, files
from loopvq_calib.data.corpus import PIECE_CHARS, build_calibration_set
from loopvq_calib.data.files import DataError

LINE_BYTES = 48 << 20  # one line of this many bytes: 48 MiB of words
BOUND = 2 << 20  # DOCUMENT_BYTES, lowered for the test


class CountingTokenizer:
    """The reference tokenizer, recording the length of every text it is asked to tokenize."""

    def __init__(self) -> None:
        self.inner = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
        self.eos_token_id, self.bos_token_id = self.inner.eos_token_id, self.inner.bos_token_id
        self.lengths: list[int] = []

    def __call__(self, text: str, **kwargs):
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)


@pytest.fixture(scope="module")
def counting() -> CountingTokenizer:
    return CountingTokenizer()


def test_one_huge_line_is_read_and_tokenized_only_as_far_as_the_windows_need(tmp_path, monkeypatch, counting):
    monkeypatch.setattr(files, "DOCUMENT_BYTES", BOUND)
    path = tmp_path / "one-line.txt"
    words = b"to be or not to be that is the question "
    path.write_bytes(words * (LINE_BYTES // len(words)) + b"\n")
    counting.lengths.clear()
    cfg = DataConfig(dataset=str(path), num_sequences=2, sequence_length=32, heldout_sequences=1, text_sample_by="line")
    tracemalloc.start()
    try:
        calib = build_calibration_set(cfg, counting)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LINE_BYTES // 2, peak  # the line was read to the bound, never whole (its bytes alone would pass)
    assert counting.lengths and max(counting.lengths) <= PIECE_CHARS and sum(counting.lengths) <= PIECE_CHARS
    prefix = path.read_bytes()[: counting.lengths[0]].decode()  # what was tokenized: the line's start, independently
    ids = counting.inner(prefix, add_special_tokens=False)["input_ids"]
    windows = [ids[i : i + 32] for i in range(0, len(ids) - 31, 32)]
    assert all(row in windows for row in calib.input_ids.tolist())


def test_a_long_document_is_cut_into_pieces_at_spaces_that_tokenize_like_the_whole():
    doc = "alpha beta\ngamma " * (PIECE_CHARS // 8)
    pieces = list(corpus._pieces(doc))
    assert "".join(pieces) == doc and len(pieces) > 1
    assert all(len(p) <= PIECE_CHARS for p in pieces) and all(p[0] in " \n" for p in pieces[1:])
    assert list(corpus._pieces("short")) == ["short"]


def test_a_json_line_past_the_bound_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "DOCUMENT_BYTES", 1 << 10)
    path = tmp_path / "rows.jsonl"
    long_row = json.dumps({"text": "x" * 4000})
    path.write_text(json.dumps({"text": "fine"}) + "\n" + long_row + "\n")
    with pytest.raises(
        DataError,
        match=rf"data\.dataset: {path} line 2 holds {len(long_row) + 1:,} bytes, more than "
        r"one row may hold \(1,024\); split it",
    ):
        list(corpus.load_documents(DataConfig(dataset=str(path))))


def test_a_json_array_past_its_bound_is_refused_and_a_text_document_cut(tmp_path, monkeypatch):
    monkeypatch.setitem(files.LIMITS, "JSON corpus file", 1 << 10)
    monkeypatch.setattr(files, "DOCUMENT_BYTES", (1 << 10) + 1)
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"text": "x" * 2000}]))
    with pytest.raises(DataError, match=r"holds more than 1,024 bytes, the most a JSON array file may hold .*\.jsonl"):
        list(corpus.load_documents(DataConfig(dataset=str(array))))
    text = tmp_path / "doc.txt"
    text.write_text("é" * 2000)  # two bytes a character: the bound falls inside the 513th, which is dropped
    assert list(corpus.load_documents(DataConfig(dataset=str(text), text_sample_by="document"))) == ["é" * 512]
