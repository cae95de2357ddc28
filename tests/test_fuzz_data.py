"""The fuzz table (tests/test_fuzz.py), corpora: empty, not UTF-8, broken JSON lines, JSON or parquet, without the
text field, too small for the windows asked for, missing, of an unknown type, or named by megabyte-long values. Each
case exits 2, naming it in one short line, and writes and deletes nothing (support/fuzz.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.fuzz import (
    JSONL,
    Case,
    assert_refused,
    case_ids,
    parquet_bytes,
    ws,  # noqa: F401 (the fixture)
)

CASES: list[Case] = [
    # -- corpora ---------------------------------------------------------------------------------------
    ("corpus-empty", lambda ws: ws.data("empty.jsonl", ""), 2, "data.dataset: " + "{}/empty.jsonl holds no text"),
    ("corpus-whitespace", lambda ws: ws.data("blank.jsonl", json.dumps({"text": "   "}) + "\n"), 2, "holds no text"),
    (
        "corpus-jsonl-not-utf8",
        lambda ws: ws.data("l1.jsonl", b'{"text": "caf\xe9"}\n'),
        2,
        "l1.jsonl is not UTF-8 text: byte offset 13",
    ),
    (
        "corpus-txt-not-utf8",
        lambda ws: ws.data("l1.txt", b"ok\n\xff\xfe"),
        2,
        "l1.txt is not UTF-8 text: byte offset 3",
    ),
    (
        "corpus-broken-jsonl",
        lambda ws: ws.data("broken.jsonl", JSONL + "{not json\n"),
        2,
        "broken.jsonl line 41 is not a JSON object",
    ),
    (
        "corpus-json-array-broken",
        lambda ws: ws.data("broken.json", '[{"text": "a"},'),
        2,
        "broken.json is not valid JSON",
    ),
    (
        "corpus-no-text-field",
        lambda ws: ws.data("body.jsonl", json.dumps({"body": "x"}) + "\n"),
        2,
        "data.text_field: column 'text' not in",
    ),
    (
        "corpus-parquet-no-column",
        lambda ws: ws.data("p.parquet", parquet_bytes()),
        2,
        "data.text_field: column 'text' not in",
    ),
    (
        "corpus-parquet-garbage",
        lambda ws: ws.data("g.parquet", b"PAR1 this is not parquet"),
        2,
        "g.parquet is not a readable parquet file",
    ),
    (
        "corpus-too-small",
        lambda ws: ws.data("small.jsonl", json.dumps({"text": "tiny"}) + "\n"),
        2,
        "only 0 windows of 32 tokens (data.sequence_length); 6 were asked for",
    ),
    (
        "corpus-missing",
        lambda ws: ws.run_with("--set", f"data.dataset={ws.root / 'none.jsonl'}"),
        2,
        "data.dataset: no local file matches",
    ),
    (
        "corpus-empty-folder",
        lambda ws: ws.run_with("--set", f"data.dataset={Path(ws.file('corp/readme.md', '#')).parent}"),
        2,
        "holds no .txt",
    ),
    ("corpus-unknown-suffix", lambda ws: ws.data("notes.md", "# x"), 2, "cannot infer the file type"),
    # -- what a file or a value can say: corpora -------------------------------------------------------
    (
        "corpus-path-huge",
        lambda ws: ws.run_with("--set", "data.dataset=" + "d" * 2_000_000 + ".jsonl"),
        2,
        "data.dataset: cannot use '/",
    ),
    (
        "corpus-text-field-huge",
        lambda ws: ws.run_with("--set", "data.text_field=" + "t" * 2_000_000),
        2,
        "data.text_field: column 'tttt",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)
