"""benchmarks/quality/finetune_report.py: the cross-model tables on small hand-made results files (the mean across
models, the best variant, the never-negative check, a model not measured) and docs/finetune.md's generated block."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT

from benchmarks.quality import finetune_grids as grids, finetune_report as report, study_finetune as study


def _study(gains: dict[str, list[float]]) -> dict:
    """A study file whose cell i holds gain gains[variant][i] of each variant (k-means KL 0.1, fine-tuned below)."""
    cells = len(next(iter(gains.values())))
    return {
        "command": "python benchmarks/quality/study_finetune.py --model x",
        "commit": "0123456789",
        "device": "NVIDIA H200",
        "cells": [
            {
                "method": m,
                "bits": b,
                "kmeans_evaluation_kl": 0.1,
                "variants": {
                    n: {"reduction": g[i], "evaluation_kl": 0.1 * (1 - g[i])}
                    for n, g in gains.items()
                    if g[i] is not None
                },
            }
            for i, (m, b) in enumerate(grids.CELLS[:cells])
        ],
    }


def _gain(changes: list[float]) -> dict:
    """A gain file whose cell i changes the evaluation KL by changes[i] (relative) from k-means' 0.2."""
    return {
        "command": "python benchmarks/quality/measure_finetune_gain.py --model x",
        "commit": "abcdef0123",
        "device": "cpu",
        "sequences": 134,
        "cells": [
            {
                "method": m,
                "bits": b,
                "change": ch,
                "kmeans": {"eval_kl": 0.2},
                "finetuned": {"eval_kl": 0.2 * (1 + ch), "selection_kl": 0.01},
                "finetune_curve": {"curve": [{"selection_kl": 0.02}]},
            }
            for (m, b), ch in zip(grids.CELLS, changes)
        ],
    }


def test_the_mean_is_over_measured_models_and_the_best_variant_has_the_highest():
    studies = {
        "ouro": _study({"shipped": [0.3, 0.1], "paper": [0.2, 0.2], "affine": [0.5, None]}),
        "huginn": _study({"shipped": [0.05, -0.05], "paper": [0.1, 0.0], "affine": [0.9, 0.9]}),
        "ouro-python": None,
    }
    rows = {r["variant"]: r for r in report.variant_rows(studies, ["shipped", "paper", "affine"], 2)}
    assert rows["shipped"]["per_model"]["ouro"] == pytest.approx((0.2, 0.1))
    assert rows["shipped"]["per_model"]["huginn"] == pytest.approx((0.0, -0.05))
    assert rows["shipped"]["per_model"]["ouro-python"] is None
    assert rows["shipped"]["mean"] == pytest.approx((0.2 + 0.0) / 2) and rows["shipped"]["worst"] == -0.05
    assert rows["paper"]["mean"] == pytest.approx((0.2 + 0.05) / 2) and rows["paper"]["worst"] == 0.0
    # affine misses a cell on ouro: no mean, so it cannot win although its huginn gain is the highest
    assert rows["affine"]["per_model"]["ouro"] is None and rows["affine"]["mean"] is None
    assert report.best_variant(list(rows.values())) == "paper"
    assert report.best_variant([rows["affine"]]) is None
    nothing = report.variant_rows({"ouro": None, "huginn": None}, ["shipped"], 4)  # no measured model: no mean
    assert nothing[0]["mean"] is None and report.best_variant(nothing) is None


def test_never_negative_names_each_cell_worse_than_kmeans():
    assert report.negative_cells(_gain([-0.3, -0.2, 0.0, -0.1])) == []
    assert report.negative_cells(_gain([-0.3, 0.05, -0.1, 0.01])) == ["loopvq 0.25 bit", "tasq+loopvq 0.25 bit"]
    table = report.gain_table(
        {"ouro": _gain([-0.3, -0.2, -0.25, -0.1]), "huginn": _gain([-0.1, 0.05, -0.1, -0.1]), "ouro-python": None}
    )
    assert "| ouro | loopvq 0.5 bit | 134 | 0.20000 | 0.14000 | +30.0% | 0.02000 -> 0.01000 |" in table
    assert "| ouro-python | not measured | | | | | |" in table
    assert table.endswith(
        "Never negative on the evaluation text: ouro: no cell worse than k-means; huginn: worse on loopvq 0.25 bit."
    )


def _write_results(folder, files: dict[str, dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))


def test_the_block_marks_the_best_variant_and_shows_models_not_measured(tmp_path):
    four = {"shipped": [0.2, 0.3, 0.2, 0.3], "paper": [0.1, 0.1, 0.1, 0.1]}
    _write_results(
        tmp_path,
        {
            "finetune-study-ouro.json": _study(four),
            "finetune-study-huginn.json": _study({"shipped": [0.0] * 4, "paper": [0.2] * 4}),
            "finetune-gain-huginn.json": _gain([-0.1, -0.2, -0.1, -0.2]),
        },
    )
    block = report.page_block(tmp_path)
    assert block.startswith(report.BEGIN) and block.endswith(report.END)
    assert "| shipped | +25.0% | +0.0% | not measured | +12.5% | +0.0% |" in block
    assert "| **paper** (best) | +10.0% | +20.0% | not measured | **+15.0%** | +10.0% |" in block
    assert "| lr3e-3 | - | - | not measured | - | - |" in block
    assert "| ouro | +25.0% | not measured | not measured |" in block  # 64 sequences and the gain: no files
    assert "| huginn | +0.0% | not measured | +15.0% (134) |" in block
    assert "| ouro | not measured | | | | | |" in block
    assert (
        f"`{tmp_path}/finetune-gain-huginn.json`: `python benchmarks/quality/measure_finetune_gain.py --model x`, "
        "commit abcdef0, cpu" in block
    )


def test_write_replaces_only_the_generated_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\nbefore\n\n{report.BEGIN}\n\nold\n\n{report.END}\n\nafter\n")
    report.write_block(page, f"{report.BEGIN}\n\nnew\n\n{report.END}")
    assert page.read_text() == f"# Page\n\nbefore\n\n{report.BEGIN}\n\nnew\n\n{report.END}\n\nafter\n"
    page.write_text("# Page without a block\n")
    with pytest.raises(SystemExit, match="no generated block"):
        report.write_block(page, "x")


def test_the_committed_page_holds_the_block_the_stored_results_give(tmp_path, monkeypatch, capsys):
    page = tmp_path / "finetune.md"
    page.write_text((ROOT / "docs" / "finetune.md").read_text())
    monkeypatch.setattr(sys, "argv", ["study_finetune.py", "--report", "--write", str(page)])
    study.main()
    assert page.read_text() == (ROOT / "docs" / "finetune.md").read_text()
    assert capsys.readouterr().out.strip() == report.page_block(ROOT / "benchmarks" / "results")


def test_a_model_measured_on_some_cells_shows_their_mean_and_count_but_no_cross_model_mean():
    partial = _study({"shipped": [0.04, 0.06], "paper": [0.01, None]})  # cells 0 and 1 of 4
    table = report.variant_table({"a": partial, "b": None}, "levers")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    assert rows["shipped"] == "| shipped | +5.0% (2 of 4 cells) | not measured | - | - |"
    assert rows["paper"] == "| paper | +1.0% (1 of 4 cells) | not measured | - | - |"
    assert rows["affine"] == "| affine | - | not measured | - | - |"
