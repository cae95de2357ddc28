"""benchmarks/quality/measure_finetune_gain.py: each cell's loopvq-calibrate arguments on each model, and one results
file per model written as cells end (a failed cell leaves the others; --resume runs only the missing ones)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

from benchmarks.quality import measure_finetune_gain as gain, reference_models as refs
from loopvq_calib.cli import PARSERS
from loopvq_calib.config.load import load_config


def test_a_cells_arguments_set_the_models_text_the_cells_quant_and_the_reference_setup(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tool runs in the checkout: the table's relative paths resolve there
    for model, method, bits, group in (("ouro", "loopvq", 0.5, 16), ("huginn", "tasq+loopvq", 0.25, 32)):
        ref = refs.MODELS[model]
        args = gain.cell_overrides(
            model, method, bits, device="cpu", overrides=[*refs.reference_overrides(134), "finetune.epochs=2"]
        )
        parsed = PARSERS["loopvq-calibrate"]().parse_args(["--config", ref.config, *args])
        cfg = load_config(parsed.config, parsed.overrides)
        assert cfg.model.name_or_path == str(ROOT / ref.folder) and cfg.data.dataset == str(ROOT / ref.calibration)
        assert (cfg.quant.method, cfg.quant.bits, cfg.quant.group_size, cfg.quant.steps_per_block) == (
            method,
            bits,
            group,
            4,
        )
        assert (cfg.data.num_sequences, cfg.data.heldout_sequences, cfg.finetune.select_every) == (
            134,
            16,
            (134 - 16) // 4,
        )
        assert cfg.finetune.epochs == 2 and cfg.finetune.autocast == "none"  # an extra override wins over the setup


def _cell(method: str, bits: float) -> dict:
    return {"method": method, "bits": bits, "setup": {"sequences": 10}, "change": -0.1}


def test_each_model_gets_its_own_file_and_a_failed_cell_leaves_the_others(tmp_path, monkeypatch, capsys):
    def fake_cell(model, method, bits, **kwargs):
        if model == "huginn" and bits == 0.25:
            raise RuntimeError("loopvq-calibrate exited 1")
        return {**_cell(method, bits), "eval_data": kwargs["eval_args"], "overrides": kwargs["overrides"]}

    monkeypatch.setattr(gain, "measure_cell", fake_cell)
    windows = {"artifacts/tiny-ouro": 188, "artifacts/tiny-huginn": 134}
    monkeypatch.setattr(gain, "calibration_windows", lambda ref: windows[ref.folder])
    monkeypatch.setattr(gain, "report", lambda path: f"table of {path.name}")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "measure_finetune_gain.py",
            "--model",
            "ouro",
            "huginn",
            "--cell",
            "0",
            "--cell",
            "1",
            "--out-dir",
            str(tmp_path),
            "--device",
            "cpu",
            "--jobs",
            "2",
            "--set",
            "finetune.epochs=1",
            "--eval-args",
            "--num-sequences 1",
        ],
    )
    with pytest.raises(SystemExit, match="huginn"):
        gain.main()
    ouro = json.loads((tmp_path / "finetune-gain-ouro.json").read_text())
    huginn = json.loads((tmp_path / "finetune-gain-huginn.json").read_text())
    assert [(c["method"], c["bits"]) for c in ouro["cells"]] == [("loopvq", 0.5), ("loopvq", 0.25)]
    assert [(c["method"], c["bits"]) for c in huginn["cells"]] == [("loopvq", 0.5)]
    assert ouro["overrides"] == [*refs.reference_overrides(188), "finetune.epochs=1"] == ouro["cells"][0]["overrides"]
    assert huginn["windows"] == 134 and huginn["sequences"] == 10 and ouro["model"] == "ouro"
    assert ouro["cells"][0]["eval_data"] == ["--num-sequences", "1"]
    assert ouro["command"].endswith("--eval-args '--num-sequences 1'")
    assert "table of finetune-gain-ouro.json" in capsys.readouterr().out


def test_resume_runs_only_the_cells_a_stored_file_lacks_and_keeps_its_setup(tmp_path, monkeypatch):
    ran = []

    def fake_cell(model, method, bits, **kwargs):
        ran.append((model, method, bits))
        return {**_cell(method, bits), "overrides": kwargs["overrides"]}

    stored = {
        "command": "first",
        "commit": "a",
        "model": "ouro",
        "overrides": ["data.num_sequences=100"],
        "cells": [_cell("tasq+loopvq", 0.5), _cell("loopvq", 0.5)],
    }
    (tmp_path / "finetune-gain-ouro.json").write_text(json.dumps(stored))
    monkeypatch.setattr(gain, "measure_cell", fake_cell)
    monkeypatch.setattr(gain, "calibration_windows", lambda ref: 1 / 0)  # a resumed file keeps its own setup
    monkeypatch.setattr(gain, "report", lambda path: "")
    monkeypatch.setattr(
        sys,
        "argv",
        ["measure_finetune_gain.py", "--model", "ouro", "--resume", "--out-dir", str(tmp_path), "--device", "cpu"],
    )
    gain.main()
    data = json.loads((tmp_path / "finetune-gain-ouro.json").read_text())
    assert ran == [("ouro", "loopvq", 0.25), ("ouro", "tasq+loopvq", 0.25)]
    assert [(c["method"], c["bits"]) for c in data["cells"]] == list(gain.CELLS)
    assert data["cells"][1]["overrides"] == ["data.num_sequences=100"] and data["command"] == "first"
    assert data["resumed"][0]["command"].endswith("--resume --out-dir " + str(tmp_path) + " --device cpu")
