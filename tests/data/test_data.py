"""Calibration corpora: every local file type, determinism, held-out split, clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REFERENCE_MODEL
from transformers import AutoTokenizer

from loopvq_calib.config.schema import Config, DataConfig
from loopvq_calib.config.source import ConfigError, shown
from loopvq_calib.config.validate import validate
from loopvq_calib.data.corpus import build_calibration_set, load_documents, local_files
from loopvq_calib.data.files import DataError

DOCS = [f"Document number {i}. " + "To be, or not to be, that is the question. " * (5 + i) for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REFERENCE_MODEL)


def write_corpus(tmp_path, kind: str):
    if kind == "text":
        path = tmp_path / "c.txt"
        path.write_text("\n\n".join(DOCS))
    elif kind == "json":
        path = tmp_path / "c.json"
        path.write_text(json.dumps([{"text": d, "id": i} for i, d in enumerate(DOCS)]))
    elif kind == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    else:
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"text": DOCS}), path)
    return path


@pytest.mark.parametrize("kind", ["json", "jsonl", "parquet"])
def test_each_structured_file_type_yields_the_documents(tmp_path, kind):
    path = write_corpus(tmp_path, kind)
    assert list(load_documents(DataConfig(dataset=str(path)))) == DOCS


def test_text_files_split_by_paragraph_line_or_document(tmp_path):
    path = write_corpus(tmp_path, "text")
    assert list(load_documents(DataConfig(dataset=str(path), text_sample_by="paragraph"))) == DOCS
    assert list(load_documents(DataConfig(dataset=str(path), text_sample_by="document"))) == ["\n\n".join(DOCS)]


def test_sequences_are_windows_of_the_separated_stream(tmp_path, tokenizer):
    path = write_corpus(tmp_path, "jsonl")
    cfg = DataConfig(dataset=str(path), num_sequences=4, sequence_length=16, heldout_sequences=1, seed=3)
    calib = build_calibration_set(cfg, tokenizer)
    stream = []
    for d in DOCS:
        stream += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = torch.tensor(stream[: len(stream) // 16 * 16]).view(-1, 16)
    for row in calib.input_ids:
        assert any(torch.equal(row, w) for w in windows)
    assert calib.input_ids.shape == (4, 16) and len(calib.heldout) == 1
    assert sorted(calib.train + calib.heldout) == [0, 1, 2, 3]


def test_same_seed_same_sequences_other_seed_differs(calib_corpus, tokenizer):
    cfg = DataConfig(dataset=str(calib_corpus), num_sequences=6, sequence_length=64, heldout_sequences=2, seed=0)
    a, b = build_calibration_set(cfg, tokenizer), build_calibration_set(cfg, tokenizer)
    assert torch.equal(a.input_ids, b.input_ids) and a.heldout == b.heldout and a.content_hash == b.content_hash
    c = build_calibration_set(DataConfig(**{**vars(cfg), "seed": 1}), tokenizer)
    assert not torch.equal(a.input_ids, c.input_ids) and a.content_hash != c.content_hash


def test_too_little_text_names_num_sequences(tmp_path, tokenizer):
    path = write_corpus(tmp_path, "jsonl")
    with pytest.raises(
        DataError,
        match=r"data\.num_sequences: .* only \d+ windows of 512 tokens \(data\.sequence_length\); 16 were asked for",
    ):
        build_calibration_set(DataConfig(dataset=str(path), num_sequences=16, sequence_length=512), tokenizer)


def test_unknown_file_type_says_how_to_set_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short path: a long one is cut short in the message
    (tmp_path / "notes.md").write_text("# text")
    with pytest.raises(DataError, match=r"data\.dataset: cannot infer the file type of .*notes\.md.*; set data\.type"):
        list(load_documents(DataConfig(dataset="notes.md")))


def test_missing_text_field_and_missing_file(tmp_path, tokenizer):
    path = write_corpus(tmp_path, "jsonl")
    with pytest.raises(DataError, match=r"data\.text_field: column 'body' not in"):
        list(load_documents(DataConfig(dataset=str(path), text_field="body")))
    with pytest.raises(DataError, match=r"data\.dataset: no local file matches"):
        list(load_documents(DataConfig(dataset=str(tmp_path / "none.jsonl"))))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_huge_text_field_or_column_list_is_shown_cut_short(tmp_path, kind):
    path = write_corpus(tmp_path, kind)
    field = "t" * 2_000_000
    with pytest.raises(DataError) as err:
        list(load_documents(DataConfig(dataset=str(path), text_field=field)))
    assert str(err.value) == f"data.text_field: column {shown(field)} not in {path} (columns: {shown(['text'])})"
    wide = tmp_path / "wide.jsonl"
    wide.write_text(json.dumps({f"c{i}": i for i in range(100_000)}) + "\n")
    with pytest.raises(
        DataError, match=r"column 'text' not in .*wide\.jsonl \(columns: \['c0', 'c1', .*\.\.\.\]\)$"
    ) as err:
        list(load_documents(DataConfig(dataset=str(wide))))
    assert len(str(err.value)) < 300


def test_a_dataset_path_the_file_system_refuses_names_its_key(tmp_path):
    spec = str(tmp_path / ("d" * 2_000_000)) + ".jsonl"
    with pytest.raises(DataError) as err:
        local_files(spec, "--data")
    assert str(err.value) == f"--data: cannot use {shown(spec)} (File name too long)"
    with pytest.raises(DataError, match=r"^data\.dataset: cannot use .* \(File name too long\)$"):
        list(load_documents(DataConfig(dataset=spec)))


def test_offline_hub_dataset_gives_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"data\.dataset: could not load 'someorg/somecorpus' .*offline mode is on"):
        list(load_documents(DataConfig(dataset="someorg/somecorpus")))


def test_an_edited_file_is_read_afresh_and_no_shared_cache_is_written(tmp_path):
    """Edited in place with the same size and mtime: the new text is read (no cache keyed on file stats), and
    nothing lands in the datasets cache (local files never go through it)."""
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE)
    before = sorted(cache.rglob("*")) if cache.exists() else []
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "alpha beta gamma"}) + "\n")
    assert list(load_documents(DataConfig(dataset=str(path)))) == ["alpha beta gamma"]
    stat = path.stat()
    path.write_text(json.dumps({"text": "omega delt gamma"}) + "\n")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert list(load_documents(DataConfig(dataset=str(path)))) == ["omega delt gamma"]
    assert (sorted(cache.rglob("*")) if cache.exists() else []) == before


@pytest.mark.parametrize(
    "name,data,offset",
    [
        ("a.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', 28),
        ("b.txt", b"fine\n\xff", 5),
        ("c.json", b'[{"text": "\xc3"}]', 11),
    ],
)
def test_non_utf8_names_the_file_and_the_byte_offset(tmp_path, name, data, offset):
    path = tmp_path / name
    path.write_bytes(data)
    assert data[offset : offset + 1] and data[:offset].decode("utf-8")  # all bytes before the offset decode
    with pytest.raises(DataError, match=rf"data\.dataset: {path} is not UTF-8 text: byte offset {offset} "):
        list(load_documents(DataConfig(dataset=str(path))))


def test_empty_corpus_names_the_dataset(tmp_path, tokenizer):
    for name, text in (("empty.jsonl", ""), ("blank.txt", "\n\n  \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"data\.dataset: {tmp_path / name} holds no text"):
            build_calibration_set(DataConfig(dataset=str(tmp_path / name), text_sample_by="line"), tokenizer)


def test_json_lines_and_arrays_give_the_same_documents(tmp_path):
    lines, array = tmp_path / "a.jsonl", tmp_path / "b.json"
    lines.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n\n")
    array.write_text(json.dumps([{"text": d} for d in DOCS], indent=2))
    assert (
        list(load_documents(DataConfig(dataset=str(lines))))
        == list(load_documents(DataConfig(dataset=str(array))))
        == DOCS
    )
    assert (
        list(load_documents(DataConfig(dataset=str(tmp_path), type="json"))) == DOCS + DOCS
    )  # a folder, in name order


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


def test_chat_template_renders_each_conversation_before_tokenizing(tmp_path, tokenizer):
    """data.chat_template: each row's messages go through the tokenizer's chat template; the stream equals the
    hand-rendered text tokenized the same way (documents separated by eos)."""
    chats = [
        [
            {"role": "user", "content": f"question {i} about the plays"},
            {"role": "assistant", "content": "an answer " * 9},
        ]
        for i in range(40)
    ]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    original, tokenizer.chat_template = tokenizer.chat_template, TEMPLATE
    try:
        cfg = DataConfig(
            dataset=str(tmp_path / "chat.jsonl"),
            text_field="messages",
            chat_template=True,
            num_sequences=2,
            sequence_length=32,
            heldout_sequences=1,
        )
        calib = build_calibration_set(cfg, tokenizer)
    finally:
        tokenizer.chat_template = original
    stream = []
    for c in chats:
        text = "".join(f"<{m['role']}> {m['content']}\n" for m in c)
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    windows = torch.tensor(stream[: len(stream) // 32 * 32]).view(-1, 32)
    assert all(any(torch.equal(row, w) for w in windows) for row in calib.input_ids)
    assert calib.description["chat_template"] is True


def test_chat_template_renders_only_the_pool_but_checks_every_row(tmp_path, tokenizer, monkeypatch):
    """Rows past the token pool are read and checked (a bad last row still fails) but not rendered."""
    chats = [
        [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "an answer " * 9}]
        for i in range(400)
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    rendered = []
    render = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "chat_template", TEMPLATE)
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda m, **kw: rendered.append(m) or render(m, **kw))
    cfg = DataConfig(
        dataset=str(path),
        text_field="messages",
        chat_template=True,
        num_sequences=2,
        sequence_length=32,
        heldout_sequences=1,
    )
    calib = build_calibration_set(cfg, tokenizer)
    assert len(rendered) == calib.description["documents_read"] < len(chats)
    assert rendered == chats[: len(rendered)]
    path.write_text(path.read_text() + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(DataError, match=r"data.text_field: .* document 400 is list"):
        build_calibration_set(cfg, tokenizer)


def test_chat_template_errors_name_the_key(tmp_path, tokenizer):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": "not a conversation"}) + "\n")
    cfg = DataConfig(
        dataset=str(tmp_path / "chat.jsonl"),
        text_field="messages",
        chat_template=True,
        num_sequences=1,
        sequence_length=8,
        heldout_sequences=0,
    )
    original, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(
            DataError, match="data.chat_template: the tokenizer of model.name_or_path has no chat template"
        ):
            build_calibration_set(cfg, tokenizer)
        tokenizer.chat_template = TEMPLATE
        with pytest.raises(
            DataError, match=r"data.text_field: with data.chat_template every row must be a non-empty list"
        ):
            build_calibration_set(cfg, tokenizer)
    finally:
        tokenizer.chat_template = original

    with pytest.raises(ConfigError, match="data.chat_template"):
        validate(Config(data=DataConfig(type="text", chat_template=True)))
