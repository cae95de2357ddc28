"""The run's model is loaded once, when the first stage that needs it runs: capture and fine-tuning share it, and a
rerun that reuses every stage loads no weights."""

from __future__ import annotations

from support.builders import tiny_config

import loopvq_calib.calibration.plan as plan_module
from loopvq_calib.calibration.pipeline import calibrate


def test_the_model_is_loaded_once_and_not_for_reused_stages(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    loads, real = [], plan_module.load_model
    monkeypatch.setattr(plan_module, "load_model", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", finetune={"epochs": 1})
    first = calibrate(cfg)
    assert [s["name"] for s in first.stages if not s["reused"]] == ["data", "capture", "kmeans", "finetune", "bundle"]
    assert loads == [tiny_ouro_dir]
    again = calibrate(cfg)
    assert all(s["reused"] for s in again.stages) and loads == [tiny_ouro_dir]
