"""The fuzz table (tests/test_fuzz.py), model folders and devices: paths missing or mistyped, hub ids not cached,
config.json missing, broken or of another type, tokenizers and shards missing or cut, another architecture's
weights, windows that are not positive integers or too short, devices that are not there. Each case exits 2, naming
it in one short line, and writes and deletes nothing (support/fuzz.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.fuzz import (
    Case,
    assert_refused,
    case_ids,
    cut_shard,
    mistyped_model_path,
    model_copy,
    shards_without_the_second,
    window,
    ws,  # noqa: F401 (the fixture)
)

NO_CUDA = not torch.cuda.is_available()

CASES: list[Case] = [
    # -- models and devices ----------------------------------------------------------------------------
    ("model-relative-typo", lambda ws: mistyped_model_path(ws), 2, "model.name_or_path: no such folder:"),
    (
        "model-absolute-missing",
        lambda ws: ws.run_with("--set", f"model.name_or_path={ws.root / 'nope'}"),
        2,
        "no such folder",
    ),
    (
        "model-hub-offline",
        lambda ws: ws.run_with("--set", "model.name_or_path=someorg/not-cached"),
        2,
        "is not in the local hub cache",
    ),
    (
        "model-no-config-json",
        lambda ws: ws.run_with("--set", f"model.name_or_path={Path(ws.file('empty-model/x.txt', 'x')).parent}"),
        2,
        "has no config.json",
    ),
    (
        "model-unsupported-type",
        lambda ws: ws.run_with(
            "--set",
            f"model.name_or_path={Path(ws.file('llama/config.json', json.dumps({'model_type': 'llama'}))).parent}",
        ),
        2,
        "model_type 'llama'",
    ),
    pytest.param(
        "model-device-cuda",
        lambda ws: ws.run_with("--set", "model.device=cuda"),
        2,
        "model.device: 'cuda' asked for, but no CUDA",
        marks=pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA"),
    ),
    (
        "kmeans-device-bad",
        lambda ws: ws.run_with("--set", "kmeans.device=gpu"),
        2,
        "kmeans.device: 'gpu' is not allowed",
    ),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    (
        "sequence-length-past-window",
        lambda ws: ws.run_with("--set", "data.sequence_length=4096"),
        2,
        "data.sequence_length: 4,096 tokens exceed the model's window of 512",
    ),
    (
        "model-config-bad-json",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text('{"model_type": "ouro",')),
        2,
        "{}/model/config.json is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 23)",
    ),
    (
        "model-config-not-utf8",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_bytes(b'{"x": "\xff"}')),
        2,
        "{}/model/config.json is not UTF-8 text (byte 7",
    ),
    (
        "model-no-tokenizer",
        lambda ws: model_copy(ws, lambda f: [t.unlink() for t in f.glob("tokenizer*")]),
        2,
        "{}/model has no tokenizer: none of tokenizer.json",
    ),
    (
        "model-truncated-shard",
        lambda ws: model_copy(ws, cut_shard),
        2,
        "{}/model/model.safetensors: truncated: its header says",
    ),
    (
        "model-missing-shard",
        lambda ws: model_copy(ws, lambda f: sorted(f.glob("*.safetensors"))[-1].unlink()),
        2,
        "{}/model has no weights (model.safetensors, or model.safetensors.index.json",
    ),
    (
        "model-type-of-other-weights",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text((ws.huginn / "config.json").read_text())),
        2,
        "the weights in {}/model are not those of its config.json's model_type 'huginn_raven'",
    ),
    # -- what a file or a value can say: models --------------------------------------------------------
    (
        "model-path-huge",
        lambda ws: ws.run_with("--set", "model.name_or_path=org/" + "a" * 2_000_000),
        2,
        "model.name_or_path: cannot use '/",
    ),
    (
        "model-window-not-an-integer",
        lambda ws: model_copy(ws, window("abc")),
        2,
        (
            "{}/model/config.json: field max_position_embeddings (the model's window) "
            "must be a positive integer, got 'abc'"
        ),
    ),
    (
        "model-missing-shard-of-the-index",
        lambda ws: model_copy(ws, shards_without_the_second),
        2,
        "{}/model/model-00002-of-00002.safetensors is missing (model.safetensors.index.json names it)",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)
