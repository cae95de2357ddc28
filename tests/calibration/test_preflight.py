"""The checks before a calibration run: a model folder with a broken file and a sequence length beyond the model's
window exit 2 naming the file or the key, before the run directory exists."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import TOKENIZER_FILES, make_tiny_huginn, make_tiny_ouro, save_with_tokenizer
from support.builders import tiny_config

from loopvq_calib.calibration.preflight import describe_model, plan_run
from loopvq_calib.cli import calibrate_main
from loopvq_calib.config.load import load_config
from loopvq_calib.config.source import ConfigError
from loopvq_calib.runtime.warmup import Warmup


def _bad_json(folder: Path) -> str:
    (folder / "config.json").write_text('{"model_type": "ouro", x}')
    return (
        f"{folder / 'config.json'} is not valid JSON: Expecting property name enclosed in double quotes "
        "(line 1, column 24)"
    )


def _non_utf8(folder: Path) -> str:
    (folder / "config.json").write_bytes(b'{"model_type": "ouro\xff"}')
    return f"{folder / 'config.json'} is not UTF-8 text (byte 20: b'\\xff')"


def _no_tokenizer(folder: Path) -> str:
    for name in TOKENIZER_FILES:
        (folder / name).unlink()
    return f"{folder} has no tokenizer: none of tokenizer.json"


def _truncated(folder: Path) -> str:
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    return f"{shard}: truncated: its tensors need"


def _missing_shard(folder: Path) -> str:
    index = {
        "metadata": {},
        "weight_map": {
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.embed_tokens.weight": "model.safetensors",
        },
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return f"{folder / 'model-00002-of-00002.safetensors'} is missing (model.safetensors.index.json names it)"


def _wrong_type(folder: Path) -> str:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    return f"model_type 'llama' in {folder}/config.json is not a supported looped model; supported: ouro, huginn_raven"


def _shapeless(folder: Path) -> str:
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "intermediate_size": "wide"}))  # no model has that shape
    return f"{folder / 'config.json'}: field intermediate_size must be a positive integer, got 'wide'"


BREAKS = [_bad_json, _non_utf8, _no_tokenizer, _truncated, _missing_shard, _wrong_type, _shapeless]


@pytest.mark.parametrize("breaks", BREAKS, ids=[b.__name__[1:] for b in BREAKS])
def test_a_broken_model_folder_exits_2_naming_the_file_before_the_run_directory(
    tiny_ouro_dir, calib_corpus, tmp_path, capsys, breaks
):
    folder = Path(shutil.copytree(tiny_ouro_dir, tmp_path / "model"))
    expected = breaks(folder)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(folder, calib_corpus, tmp_path / "run")))
    assert calibrate_main(["--config", str(cfg), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model.name_or_path: {expected}") and err.count("\n") == 1, err
    assert "Traceback" not in err and not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def short_window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """A tiny Ouro and a tiny Huginn whose window is 64 tokens: name -> (folder, the config.json field)."""
    root = tmp_path_factory.mktemp("short-window")
    return {
        "ouro": (
            save_with_tokenizer(make_tiny_ouro(max_position_embeddings=64), root / "ouro"),
            "max_position_embeddings",
        ),
        "huginn": (save_with_tokenizer(make_tiny_huginn(block_size=64), root / "huginn"), "block_size"),
    }


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_a_sequence_length_beyond_the_window_is_refused_and_the_window_itself_accepted(
    short_window_models, name, calib_corpus, tmp_path
):
    folder, field = short_window_models[name]
    assert json.loads((folder / "config.json").read_text())[field] == 64
    raw = tiny_config(folder, calib_corpus, tmp_path / "run", data={"sequence_length": 65})
    with pytest.raises(ConfigError) as err:
        plan_run(load_config(raw), warmup=Warmup())
    assert err.value.path == "data.sequence_length"
    assert str(err.value) == (
        f"data.sequence_length: 65 tokens exceed the model's window of 64 tokens ({field} in {folder / 'config.json'})"
    )
    raw["data"]["sequence_length"] = 64
    assert plan_run(load_config(raw), warmup=Warmup()).cfg.data.sequence_length == 64
    assert not (tmp_path / "run").exists()


def test_the_cli_exits_2_for_a_sequence_length_beyond_the_window(short_window_models, calib_corpus, tmp_path, capsys):
    folder, _ = short_window_models["ouro"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(folder, calib_corpus, tmp_path / "run")))
    assert calibrate_main(["--config", str(cfg), "--set", "data.sequence_length=4096"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config error: data.sequence_length: 4,096 tokens exceed the model's window of 64")
    assert not (tmp_path / "run").exists()


def test_a_data_row_nested_too_deeply_exits_2_before_the_run_directory(tiny_ouro_dir, calib_corpus, tmp_path, capsys):
    corpus = tmp_path / "deep.jsonl"
    corpus.write_text(calib_corpus.read_text() + '{"text": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, corpus, tmp_path / "run")))
    assert calibrate_main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: data.dataset: {corpus} line 3 is nested too deeply to read\n"
    assert err.count("\n") == 1 and not (tmp_path / "run").exists()


def test_the_model_is_described_once_without_its_weights(tiny_ouro_dir, calib_corpus, tmp_path):
    """describe_model: the folder, the KV sites at the run's loop count, the weights' bytes in the run's dtype and
    the identity the bundle records (a local folder by its absolute path), each check timed."""
    cfg = load_config(
        tiny_config(
            tiny_ouro_dir, calib_corpus, tmp_path / "run", model={"loop_steps": 2}, quant={"steps_per_block": 2}
        )
    )
    timings = {}
    facts = describe_model(cfg, timings)
    model = make_tiny_ouro()
    model.config.total_ut_steps = 2
    assert facts.folder == tiny_ouro_dir and facts.kv == model.kv_layout() and facts.kv.loop_steps == 2
    assert facts.weight_bytes == sum(p.numel() for p in model.parameters()) * 4  # float32
    assert facts.identity.name == str(tiny_ouro_dir.resolve()) and facts.config.model_type == "ouro"
    assert set(timings) == {"model_shape_s", "model_identity_s"}
