"""benchmarks/quality/study_finetune.py and benchmarks/quality/reference_models.py: the grid's recipes, the per-model settings and
the study file written cell by cell."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from conftest import ROOT, load_script
from transformers import AutoTokenizer

from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import DataConfig, FinetuneConfig
from loopvq_calib.data.corpus import build_calibration_set
from loopvq_calib.data.files import DataError

refs = load_script("reference_models")
study = load_script("study_finetune")


def test_the_shipped_variant_is_the_default_recipe_and_every_variant_is_a_whole_recipe():
    default = FinetuneConfig()
    assert study.SHIPPED == {k: getattr(default, k) for k in study.RECIPE_KEYS}
    for name, recipe in study.VARIANTS.items():
        assert set(recipe) == set(study.RECIPE_KEYS), name
        FinetuneConfig(**recipe)
    assert study.PAPER == {**study.SHIPPED, "lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0,
                           "select_every": 0, "proximal": 0.0}
    for grid in study.GRIDS.values():
        assert set(grid.variants) <= set(study.VARIANTS) and set(study.QUANT) <= set(study.VARIANTS)


@pytest.mark.parametrize("train", [12, 48, 172])
def test_scaled_recipes_keep_their_selection_points_per_epoch(train):
    for name, recipe in study.VARIANTS.items():
        got = study.scaled(recipe, train)
        assert {k: v for k, v in got.items() if k != "select_every"} == {
            k: v for k, v in recipe.items() if k != "select_every"}
        if recipe["select_every"] == 0:
            assert got["select_every"] == 0
        else:  # optimizer steps per epoch / steps between points, as at 12 training sequences (within rounding)
            at_12 = 12 / recipe["batch_size"] / recipe["select_every"]
            assert train / recipe["batch_size"] / got["select_every"] == pytest.approx(at_12, rel=0.1), name


def test_a_cells_config_is_the_models_config_with_its_text_and_the_cells_quant_keys(tmp_path):
    grid = study.GRIDS["levers"]
    raw = study.run_config("huginn", "tasq+loopvq", 0.25, grid=grid, sharing="heads", device="cpu", run_dir=tmp_path)
    cfg, demo = load_config(raw), load_config(ROOT / "configs" / "tiny-huginn.yaml")
    assert cfg.model.name_or_path == str(ROOT / "artifacts" / "tiny-huginn")
    assert cfg.data.dataset == str(ROOT / "artifacts" / "data" / "python-calib.jsonl")
    assert (cfg.data.num_sequences, cfg.data.heldout_sequences) == (16, 4)
    assert (cfg.quant.method, cfg.quant.bits, cfg.quant.group_size, cfg.quant.codebook_size) == ("tasq+loopvq", 0.25,
                                                                                                  32, 256)
    assert cfg.quant.steps_per_block == 4 and cfg.quant.codebook_sharing == "heads"
    assert (cfg.kmeans.iterations, cfg.kmeans.tolerance) == (100, 1e-5)
    assert cfg.data.sink_tokens == demo.data.sink_tokens and asdict(cfg.output.serving) == asdict(demo.output.serving)


def test_reference_overrides_on_188_windows_are_the_ouro_reference_config():
    """The reference setup of the gain measurement, applied to the Ouro demo config at the 188 windows the shipped
    tokenizer cuts, is configs/tiny-ouro-reference.yaml (but its run folder)."""
    got = load_config(ROOT / "configs" / "tiny-ouro.yaml", refs.reference_overrides(188)).to_dict()
    want = load_config(ROOT / "configs" / "tiny-ouro-reference.yaml").to_dict()
    got["output"].pop("dir"), want["output"].pop("dir")
    assert got == want


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_calibration_windows_are_what_the_data_stage_can_cut(name):
    model = refs.MODELS[name]
    windows = refs.calibration_windows(model)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / model.folder)

    def cut(n: int):
        return build_calibration_set(DataConfig(dataset=str(ROOT / model.calibration), num_sequences=n,
                                                sequence_length=512, heldout_sequences=0), tokenizer)

    assert cut(windows).input_ids.shape == (windows, 512)
    with pytest.raises(DataError, match="windows"):
        cut(windows + 1)


def _cell(method: str, bits: float, variants: dict[str, float]) -> dict:
    return {"method": method, "bits": bits, "variants": {n: {"reduction": r} for n, r in variants.items()}}


def test_cells_are_saved_in_the_grids_order_and_a_resumed_file_keeps_them(tmp_path):
    grid = study.Grid(16, ("shipped", "paper"))
    path, lock = tmp_path / "finetune-study-ouro.json", tmp_path / "runs" / "ouro.lock"
    study.start_file(path, {"command": "first", "commit": "a"}, resume=False)
    study.save_cell(path, _cell("tasq+loopvq", 0.5, {"shipped": 0.1}), grid=grid, lock=lock)
    study.save_cell(path, _cell("loopvq", 0.25, {"shipped": 0.2, "paper": 0.1}), grid=grid, lock=lock)
    study.save_cell(path, _cell("tasq+loopvq", 0.5, {"shipped": 0.1, "paper": 0.3}), grid=grid, lock=lock)
    data = json.loads(path.read_text())
    assert [(c["method"], c["bits"]) for c in data["cells"]] == [("loopvq", 0.25), ("tasq+loopvq", 0.5)]
    assert data["cells"][1]["variants"]["paper"] == {"reduction": 0.3} and data["device"] == "cpu"
    assert all(study.cell_done(c, grid) for c in data["cells"])
    assert not study.cell_done(_cell("loopvq", 0.5, {"shipped": 0.1}), grid)
    study.start_file(path, {"command": "second", "commit": "b"}, resume=True)
    data = json.loads(path.read_text())
    assert data["command"] == "first" and data["resumed"] == [{"command": "second", "commit": "b"}]
    assert len(data["cells"]) == 2
    study.start_file(path, {"command": "third", "commit": "c"}, resume=False)
    assert json.loads(path.read_text()) == {"command": "third", "commit": "c", "cells": []}


def test_results_files_are_named_per_model_and_grid():
    assert study.results_name("huginn", "levers") == "finetune-study-huginn.json"
    assert study.results_name("ouro", "data") == "finetune-study-ouro-data.json"
    assert refs.SHIPPED_MODELS == ("ouro", "huginn") and not refs.MODELS["ouro-python"].folder.startswith("artifacts")
