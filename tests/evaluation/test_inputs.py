"""loopvq-eval's checks of the model before its weights are read: the window against --sequence-length and the
passkey lengths, and the model folder's files, each an exit 2 naming the flag or the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import (
    make_tiny_huginn,
    make_tiny_ouro,
    needs_lm_eval,
    save_with_tokenizer,
    tiny_quantizer,
    write_tiny_bundle,
)

from loopvq_calib.cli import eval_main
from loopvq_calib.data.files import DataError
from loopvq_calib.evaluation import inputs
from loopvq_calib.evaluation.evaluate import evaluate
from loopvq_calib.evaluation.inputs import EvalInputError, data_source
from loopvq_calib.evaluation.options import ServedOptions
from loopvq_calib.evaluation.passkey import NEW_TOKENS

WINDOW = 64


@pytest.fixture(scope="module")
def short_window(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, str]]:
    """A tiny Ouro and a tiny Huginn with a 64-token window and a bundle of each: name -> (model folder, bundle,
    the config.json field of the window)."""
    root = tmp_path_factory.mktemp("eval-window")
    out = {}
    for name, model, field in (
        ("ouro", make_tiny_ouro(max_position_embeddings=WINDOW), "max_position_embeddings"),
        ("huginn", make_tiny_huginn(block_size=WINDOW), "block_size"),
    ):
        folder = save_with_tokenizer(model, root / name)
        bundle = write_tiny_bundle(root / f"{name}-bundle", folder, quantizer=tiny_quantizer(folder))
        out[name] = (folder, bundle, field)
    return out


def no_loading(*args, **kwargs):
    raise AssertionError("the model was loaded before the window was checked")


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_a_sequence_length_beyond_the_window_is_refused_before_the_model_loads(short_window, name, monkeypatch):
    folder, bundle, field = short_window[name]
    assert json.loads((folder / "config.json").read_text())[field] == WINDOW
    with monkeypatch.context() as m:
        m.setattr(inputs, "load_model", no_loading)
        with pytest.raises(EvalInputError) as err:
            evaluate([bundle], model=str(folder), num_sequences=1, sequence_length=WINDOW + 1, device="cpu")
    assert str(err.value) == (
        f"--sequence-length {WINDOW + 1} exceeds the model's window of {WINDOW} tokens ({field} "
        f"in {folder / 'config.json'})"
    )
    report = evaluate([bundle], model=str(folder), num_sequences=1, sequence_length=WINDOW, device="cpu").report
    assert report["bundles"][0]["kl_positions"] == WINDOW - 8  # the window itself is measured, past the 8 sinks


@needs_lm_eval
def test_passkey_lengths_beyond_the_window_are_refused_before_the_model_loads(short_window, monkeypatch):
    folder, bundle, _ = short_window["ouro"]
    monkeypatch.setattr(inputs, "load_model", no_loading)
    served = ServedOptions(passkey_lengths=[16, WINDOW - NEW_TOKENS + 1], passkey_trials=1)
    with pytest.raises(
        EvalInputError,
        match=rf"--passkey-lengths \[{WINDOW - NEW_TOKENS + 1}\]: prompts plus "
        rf"{NEW_TOKENS} new tokens exceed the model's window of {WINDOW} tokens",
    ):
        evaluate([bundle], model=str(folder), num_sequences=1, sequence_length=32, device="cpu", served=served)


def test_the_cli_exits_2_naming_the_flag_and_the_window(short_window, capsys):
    folder, bundle, _ = short_window["huginn"]
    assert (
        eval_main(
            [
                "--bundle",
                str(bundle),
                "--model",
                str(folder),
                "--sequence-length",
                "4096",
                "--num-sequences",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        f"error: --sequence-length 4,096 exceeds the model's window of {WINDOW} tokens "
        f"(block_size in {folder / 'config.json'})\n"
    )


@pytest.mark.parametrize(
    "breaks, message",
    [
        (lambda f: (f / "config.json").write_text("{"), "config.json is not valid JSON: Expecting property name"),
        (
            lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:-4]),
            "model.safetensors: truncated: its tensors need",
        ),
        (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer: none of tokenizer.json"),
    ],
    ids=["config", "shard", "tokenizer"],
)
def test_a_broken_model_folder_exits_2_naming_the_file(short_window, tmp_path, capsys, breaks, message):
    folder, bundle, _ = short_window["ouro"]
    broken = Path(shutil.copytree(folder, tmp_path / "model"))
    breaks(broken)
    assert (
        eval_main(
            [
                "--bundle",
                str(bundle),
                "--model",
                str(broken),
                "--num-sequences",
                "1",
                "--sequence-length",
                "32",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model: {broken}") and message in err and err.count("\n") == 1, err


def test_held_out_data_nested_too_deeply_is_bad_input(short_window, heldout_corpus, tmp_path):
    deep = '{"text": "x", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
    first = tmp_path / "first.jsonl"
    first.write_text(deep)
    with pytest.raises(DataError, match=f"^--data: {first} line 1 is nested too deeply to read$"):
        data_source(str(first), 1, 32)
    later = tmp_path / "later.jsonl"  # read in full only once the model's tokenizer is there
    later.write_text(heldout_corpus.read_text() + deep)
    folder, bundle, _ = short_window["ouro"]
    with pytest.raises(DataError, match=f"^--data: {later} line \\d+ is nested too deeply to read$"):
        evaluate([bundle], model=str(folder), data=str(later), num_sequences=1, sequence_length=32, device="cpu")
