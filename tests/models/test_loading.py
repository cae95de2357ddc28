"""Model-folder checks before any weight is read: config.json, the weight shards and the tokenizer's files, each
failure a ModelLoadError naming the file; the model's window."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES, make_tiny_ouro, save_with_tokenizer, tiny_huginn_config, tiny_ouro_config

from loopvq_calib.models.loading import (
    WEIGHTS_INDEX,
    ModelLoadError,
    check_model_folder,
    load_model,
    load_tokenizer,
    model_identity,
    model_window,
    resolve_model_dir,
    weight_files,
)

KEY = "model.name_or_path"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Ouro in three safetensors shards with an index, and the reference tokenizer."""
    folder = tmp_path_factory.mktemp("sharded")
    make_tiny_ouro().save_pretrained(folder, max_shard_size="500KB")
    for name in TOKENIZER_FILES:
        shutil.copy(Path(__file__).resolve().parents[2] / "artifacts" / "tiny-ouro" / name, folder / name)
    return folder


@pytest.fixture
def model_dir(sharded: Path, tmp_path: Path) -> Path:
    """A copy of :func:`sharded` for a test to break."""
    return Path(shutil.copytree(sharded, tmp_path / "model"))


def shards(folder: Path) -> list[str]:
    """The shard names the index lists, read here without the toolkit."""
    return sorted(set(json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"].values()))


def refused(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as err:
        check_model_folder(folder, KEY)
    assert str(err.value).startswith(f"{KEY}: ")
    return str(err.value)


def test_a_whole_folder_passes_and_lists_the_shards_of_its_index(model_dir):
    assert len(shards(model_dir)) == 3
    assert check_model_folder(model_dir).model_type == "ouro"
    assert weight_files(model_dir) == [model_dir / name for name in shards(model_dir)]


@pytest.mark.parametrize("content", [b'{"model_type": "ouro", x}', b'{\n  "model_type": "ouro",\n}', b"", b"[1"])
def test_invalid_json_in_config_json_names_the_file_and_position(model_dir, content):
    (model_dir / "config.json").write_bytes(content)
    with pytest.raises(json.JSONDecodeError) as expected:  # the position, found independently
        json.loads(content)
    e = expected.value
    assert refused(model_dir) == (
        f"{KEY}: {model_dir / 'config.json'} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
    )


def test_non_utf8_and_non_object_config_json_name_the_file(model_dir):
    text = b'{"model_type": "ouro\xff"}'
    bad = text.index(b"\xff")
    (model_dir / "config.json").write_bytes(text)
    assert refused(model_dir) == f"{KEY}: {model_dir / 'config.json'} is not UTF-8 text (byte {bad}: b'\\xff')"
    (model_dir / "config.json").write_text("[1, 2]")
    assert refused(model_dir) == f"{KEY}: {model_dir / 'config.json'} must hold a JSON object, not list"
    (model_dir / "config.json").unlink()
    assert refused(model_dir) == f"{KEY}: {model_dir} has no config.json"


def test_a_wrong_model_type_names_config_json_and_the_supported_ones(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    assert refused(model_dir) == (
        f"{KEY}: model_type 'llama' in {model_dir}/config.json is not a supported looped "
        "model; supported: ouro, huginn_raven"
    )


def test_a_config_transformers_refuses_names_config_json(model_dir):
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "use_sliding_window": True}))
    assert refused(model_dir).startswith(f"{KEY}: {model_dir}/config.json: Ouro config: use_sliding_window=true")


def test_a_missing_tokenizer_names_the_folder_and_what_is_missing(model_dir):
    for name in TOKENIZER_FILES:
        (model_dir / name).unlink()
    message = refused(model_dir)
    assert message.startswith(f"{KEY}: {model_dir} has no tokenizer: none of tokenizer.json, tokenizer.model")
    assert "sentencepiece" not in message


def test_a_broken_tokenizer_names_the_folder(model_dir):
    (model_dir / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=rf"^{KEY}: the tokenizer in {model_dir} does not load: \w+"):
        load_tokenizer(model_dir)


def test_a_shard_cut_inside_its_header_names_the_shard(model_dir):
    shard = model_dir / shards(model_dir)[1]
    header_bytes = int.from_bytes(shard.read_bytes()[:8], "little")
    cut = 8 + header_bytes // 2
    shard.write_bytes(shard.read_bytes()[:cut])
    assert refused(model_dir) == (
        f"{KEY}: {shard}: truncated: its header says {header_bytes:,} bytes, the file "
        f"holds {cut - 8:,} after the length"
    )
    shard.write_bytes(b"\x01")
    assert refused(model_dir) == f"{KEY}: {shard}: not a safetensors file (1 bytes; truncated?)"


def test_a_shard_cut_inside_its_tensors_names_the_shard(model_dir):
    shard = model_dir / shards(model_dir)[2]
    whole = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-100])
    assert (
        refused(model_dir)
        == f"{KEY}: {shard}: truncated: its tensors need {whole:,} bytes, the file has {whole - 100:,}"
    )
    with pytest.raises(ModelLoadError, match="truncated"):  # also before the loader reads a tensor
        load_model(model_dir, "float32", torch.device("cpu"))


def test_a_shard_with_a_garbage_header_names_the_shard(model_dir):
    shard = model_dir / shards(model_dir)[0]
    shard.write_bytes((8).to_bytes(8, "little") + b"not json" + b"\0" * 64)
    assert refused(model_dir) == (
        f"{KEY}: {shard}: not a safetensors file (its header is no valid tensor table: JSONDecodeError)"
    )


def test_a_missing_shard_is_named_with_the_index(model_dir):
    shard = model_dir / shards(model_dir)[1]
    shard.unlink()
    assert refused(model_dir) == f"{KEY}: {shard} is missing ({WEIGHTS_INDEX} names it)"


def test_an_index_naming_a_file_outside_the_folder_is_refused(model_dir):
    outside = model_dir.parent / "outside.safetensors"
    shutil.copy(model_dir / shards(model_dir)[0], outside)  # a whole shard that must not be read
    index = json.loads((model_dir / WEIGHTS_INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "../outside.safetensors"
    (model_dir / WEIGHTS_INDEX).write_text(json.dumps(index))
    assert refused(model_dir) == (
        f"{KEY}: {model_dir / WEIGHTS_INDEX} names '../outside.safetensors', not a file name in {model_dir}"
    )
    (model_dir / WEIGHTS_INDEX).write_text('{"weight_map": [')
    assert refused(model_dir).startswith(f"{KEY}: {model_dir / WEIGHTS_INDEX} is not a valid weight index")


def test_a_folder_without_weights_says_so(model_dir):
    (model_dir / WEIGHTS_INDEX).unlink()
    for shard in model_dir.glob("*.safetensors"):
        shard.unlink()
    assert refused(model_dir) == (
        f"{KEY}: {model_dir} has no weights (model.safetensors, or {WEIGHTS_INDEX} and the shards it names)"
    )


def test_the_identity_of_a_folder_with_a_broken_config_names_the_file(model_dir):
    (model_dir / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match=rf"^{model_dir / 'config.json'} is not valid JSON"):
        model_identity(model_dir, "m")


def test_unsharded_folder_is_checked_too(tmp_path):
    folder = save_with_tokenizer(make_tiny_ouro(), tmp_path / "single")
    assert weight_files(folder) == [folder / "model.safetensors"]
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match=f"{folder / 'model.safetensors'}: truncated: its tensors need"):
        check_model_folder(folder)


def test_the_window_is_max_position_embeddings_for_ouro_and_block_size_for_huginn():
    assert model_window(tiny_ouro_config(max_position_embeddings=300)) == (300, "max_position_embeddings")
    assert model_window(tiny_huginn_config(block_size=200)) == (200, "block_size")


@pytest.mark.parametrize("value", ["abc", -1, 0, 512.0, True, None])
def test_a_window_that_is_not_a_positive_integer_names_the_field_and_config_json(model_dir, value):
    config = tiny_ouro_config(max_position_embeddings=512)
    config.max_position_embeddings, config._name_or_path = value, str(model_dir)
    with pytest.raises(
        ModelLoadError,
        match=rf"^{model_dir}/config\.json: field max_position_embeddings \(the model's "
        rf"window\) must be a positive integer, got {re.escape(repr(value))}$",
    ):
        model_window(config)


def test_a_model_path_the_file_system_refuses_names_the_key_and_stays_short(tmp_path):
    name = str(tmp_path / "org" / ("a" * 2_000_000))
    with pytest.raises(ModelLoadError) as err:
        resolve_model_dir(name, key="--model")
    message = str(err.value)
    assert message.startswith("--model: cannot use '") and message.endswith("as a model folder (File name too long)")
    assert len(message) < 200
