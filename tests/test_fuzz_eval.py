"""The fuzz table (tests/test_fuzz.py), evaluations: bundles missing, not cached, too deep or without their model,
evaluation data empty, not UTF-8, missing or named by a megabyte-long path, options out of range, an output that is
a file, a model window too short or not a positive integer. Each case exits 2, naming it in one short line, and
writes and deletes nothing (support/fuzz.py)."""

from __future__ import annotations

import pytest
from support.fuzz import (
    DEEP,
    Case,
    assert_refused,
    case_ids,
    eval_with_window,
    tiny_eval,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib.cli import eval_main

CASES: list[Case] = [
    # -- bundles: eval ---------------------------------------------------------------------------------
    (
        "eval-missing-bundle",
        lambda ws: (eval_main, ["--bundle", str(ws.root / "nope")]),
        2,
        "ws/nope: no such bundle folder",
    ),
    (
        "eval-hub-bundle-offline",
        lambda ws: (eval_main, ["--bundle", "someorg/not-cached-bundle"]),
        2,
        "not in the local hub cache",
    ),
    (
        "eval-data-empty",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("e.jsonl", "")]),
        2,
        "e.jsonl: holds no text",
    ),
    (
        "eval-data-not-utf8",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("l.txt", b"\xe9")]),
        2,
        "--data: {}/l.txt is not UTF-8 text: byte offset 0",
    ),
    (
        "eval-data-missing",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", str(ws.root / "no.jsonl")]),
        2,
        "no such file or folder",
    ),
    (
        "eval-num-sequences-zero",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--num-sequences", "0"]),
        2,
        "need --num-sequences >= 1 and --sequence-length >= 2, got 0, 512",
    ),
    (
        "eval-max-kl-nan",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--max-kl", "nan"]),
        2,
        "--max-kl must be a finite number",
    ),
    (
        "eval-device-bad",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--device", "tpu"]),
        2,
        "--device 'tpu' is not allowed",
    ),
    (
        "eval-out-is-file",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--out", ws.file("rep", "x")]),
        2,
        "rep: exists and is not a folder",
    ),
    ("eval-bundle-model-missing", lambda ws: (eval_main, ["--bundle", ws.bundle()]), 2, "golden/ouro_loopvq"),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    (
        "eval-sequence-length-past-window",
        lambda ws: tiny_eval(ws, "--sequence-length", "4096"),
        2,
        "--sequence-length 4,096 exceeds the model's window of 512 tokens (max_position_embeddings in",
    ),
    # -- what a file can say: bundles ------------------------------------------------------------------
    (
        "eval-meta-too-deep",
        lambda ws: (eval_main, ["--bundle", ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP))]),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    # -- what a file or a value can say: models, corpora -----------------------------------------------
    (
        "eval-data-path-huge",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", "x" * 2_000_000 + ".jsonl"]),
        2,
        ".jsonl': File name too long (no file system takes a name that long)",
    ),
    (
        "eval-model-window-negative",
        lambda ws: eval_with_window(ws, -1),
        2,
        "{}/model/config.json: field max_position_embeddings (the model's window) must be a positive integer, got -1",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)
