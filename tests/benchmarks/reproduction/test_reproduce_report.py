"""benchmarks/reproduction/reproduce_report.py and reproduce_figures.py: docs/quality.md and its figures from the
stored results."""

from __future__ import annotations

import json

from conftest import ROOT

from benchmarks.reproduction import reproduce_figures as figures, reproduce_report as rr


def test_the_committed_page_is_the_one_the_stored_results_give(tmp_path):
    out = tmp_path / "quality.md"
    rr.write_page(out)
    text = out.read_text()
    assert text == (ROOT / "docs" / "quality.md").read_text()
    assert len(text.splitlines()) <= 300 and text.count("*Setup: ") == 8  # every table says its setup


def test_the_figures_are_drawn_from_the_stored_study(tmp_path):
    figures.draw(json.loads(rr.STUDY.read_text()), tmp_path / "figs")
    drawn = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert drawn == ["finetune_curves.png", "nmse.png", "per_step_kl.png", "structure.png"]
    assert all((tmp_path / "figs" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in drawn)
    page = (ROOT / "docs" / "quality.md").read_text()
    assert all(f"(figures/{name})" in page and (ROOT / "docs" / "figures" / name).is_file() for name in drawn)
