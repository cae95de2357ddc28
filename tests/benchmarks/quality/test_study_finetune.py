"""benchmarks/quality/study_finetune.py: a cell's calibration config on a reference model, and the study file written
cell by cell (a resumed file keeps its cells)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from conftest import ROOT

from benchmarks.quality import finetune_grids as grids, study_finetune as study
from loopvq_calib.config.load import load_config


def test_a_cells_config_is_the_models_config_with_its_text_and_the_cells_quant_keys(tmp_path):
    grid = grids.GRIDS["levers"]
    raw = study.run_config("huginn", "tasq+loopvq", 0.25, grid=grid, sharing="heads", device="cpu", run_dir=tmp_path)
    cfg, demo = load_config(raw), load_config(ROOT / "configs" / "tiny-huginn.yaml")
    assert cfg.model.name_or_path == str(ROOT / "artifacts" / "tiny-huginn")
    assert cfg.data.dataset == str(ROOT / "artifacts" / "data" / "python-calib.jsonl")
    assert (cfg.data.num_sequences, cfg.data.heldout_sequences) == (16, 4)
    assert (cfg.quant.method, cfg.quant.bits, cfg.quant.group_size, cfg.quant.codebook_size) == (
        "tasq+loopvq",
        0.25,
        32,
        256,
    )
    assert cfg.quant.steps_per_block == 4 and cfg.quant.codebook_sharing == "heads"
    assert (cfg.kmeans.iterations, cfg.kmeans.tolerance) == (100, 1e-5)
    assert cfg.data.sink_tokens == demo.data.sink_tokens and asdict(cfg.output.serving) == asdict(demo.output.serving)


def _cell(method: str, bits: float, variants: dict[str, float]) -> dict:
    return {"method": method, "bits": bits, "variants": {n: {"reduction": r} for n, r in variants.items()}}


def test_cells_are_saved_in_the_grids_order_and_a_resumed_file_keeps_them(tmp_path):
    grid = grids.Grid(16, ("shipped", "paper"))
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


def test_study_merge_records_the_merge_and_each_parts_command(tmp_path):
    """A merged study file names the merge as its command and keeps each per-cell file's command and cells."""
    files = []
    for n in range(2):
        part = {
            "command": f"python benchmarks/quality/study_finetune.py --grid batch2 --cell {n}",
            "commit": "abc",
            "cells": [{"method": "loopvq", "bits": 0.5 / (n + 1)}],
            "total_s": 10.0 + n,
        }
        files.append(str(tmp_path / f"b{n}.json"))
        Path(files[-1]).write_text(json.dumps(part))
    merged = study.merge(files, "all.json")
    command = f"python benchmarks/quality/study_finetune.py --merge {files[0]} {files[1]} --out all.json"
    assert merged["command"] == command
    assert merged["parts"] == [
        "python benchmarks/quality/study_finetune.py --grid batch2 --cell 0",
        "python benchmarks/quality/study_finetune.py --grid batch2 --cell 1",
    ]
    assert merged["cells"] == [{"method": "loopvq", "bits": 0.5}, {"method": "loopvq", "bits": 0.25}]
    assert merged["total_s"] == 11.0 and merged["commit"] == "abc"
