"""A failed run names the stage that raised (``Pipeline.failed_stage``), never one an older record says failed."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml
from support.builders import tiny_config

import loopvq_calib.calibration.pipeline as pipeline_module
import loopvq_calib.calibration.stages as stages_module
from loopvq_calib.calibration.pipeline import Pipeline
from loopvq_calib.calibration.stage_table import STAGES
from loopvq_calib.cli import calibrate_main
from loopvq_calib.config.load import load_config


def failing(message: str):
    def fail(*args, **kwargs):
        raise RuntimeError(message)

    return fail


def test_the_stage_that_raised_is_named_even_when_an_older_record_says_another_failed(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    monkeypatch.setattr(stages_module, "write_bundle", failing("disk full"))
    first = Pipeline(load_config(tiny_config(tiny_ouro_dir, calib_corpus, out)))
    with pytest.raises(RuntimeError, match="disk full"):
        first.run_all()
    assert first.failed_stage == "bundle"
    monkeypatch.setattr(stages_module, "save_finetune", failing("cannot save"))
    second = Pipeline(load_config(tiny_config(tiny_ouro_dir, calib_corpus, out, finetune={"epochs": 1})))
    with pytest.raises(RuntimeError, match="cannot save"):
        second.run_all()
    assert second.failed_stage == "finetune"
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    stale = [name for name, rec in stages.items() if rec["status"] in ("failed", "running")]
    assert stale == ["finetune", "bundle"]  # the last of them is not the one that failed


def test_a_failure_in_a_stages_use_of_a_reused_result_names_that_stage(tiny_ouro_dir, calib_corpus, tmp_path):
    cfg = load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"))
    Pipeline(cfg, None, ["kmeans"]).run_all()
    table = tuple(
        dataclasses.replace(s, load=failing("unreadable codebooks")) if s.name == "kmeans" else s for s in STAGES
    )
    again = Pipeline(cfg, None, ["kmeans"], table=table)
    with pytest.raises(RuntimeError, match="unreadable codebooks"):
        again.run_all()
    assert again.failed_stage == "kmeans"
    assert all(s.reused for s in again.run.records)  # the stage itself was reused; loading its result failed


def test_no_stage_is_named_when_none_failed(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    cfg = load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"))
    done = Pipeline(cfg, None, ["data"])
    done.run_all()
    assert done.failed_stage is None
    monkeypatch.setattr(pipeline_module, "selection_metrics", failing("after the stages"))
    later = Pipeline(cfg, None, ["finetune"])
    with pytest.raises(RuntimeError, match="after the stages"):
        later.run_all()
    assert later.failed_stage is None and later.run.records[-1].name == "finetune"


def test_the_console_names_the_stage_that_raised_not_a_stale_record(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, out)))
    monkeypatch.setattr(stages_module, "write_bundle", failing("disk full"))
    assert calibrate_main(["--config", str(cfg_file)]) == 3
    last = capsys.readouterr().err.splitlines()[-1]  # the run's log lines come first
    assert last.startswith("error: stage bundle failed: RuntimeError: disk full")
    monkeypatch.setattr(stages_module, "save_finetune", failing("cannot save"))
    assert calibrate_main(["--config", str(cfg_file), "--set", "finetune.epochs=1"]) == 3
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("error: stage finetune failed: RuntimeError: cannot save (traceback in ")
    assert sum(line.startswith("error:") for line in lines) == 1
    assert "Traceback" in (out / "run.log").read_text()
