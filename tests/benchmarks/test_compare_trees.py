"""benchmarks/calibration/compare_trees.sh scaled down on the CPU: one line per run, the other tree first, each with its exit
status, command seconds and its stages from the run's manifest; nothing left in its work folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


@pytest.mark.slow  # two small calibrations of a scaled-down random checkpoint
def test_both_trees_run_in_turn_and_each_run_records_its_stages(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "WORK": str(work), "PYTHON": sys.executable, "SCALE": "8"}
    small = ["--set", "data.num_sequences=4", "--set", "data.heldout_sequences=1", "--set", "data.sequence_length=128",
             "--set", "finetune.epochs=1", "--set", "model.device=cpu", "--set", "kmeans.iterations=2"]
    done = subprocess.run(["bash", "benchmarks/calibration/compare_trees.sh", str(out), str(ROOT), "1", "configs/ouro-1.4b.yaml",
                           "ouro-1.4b", *small], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (out / "compare.jsonl").read_text().splitlines()]
    assert [(line["tree"], line["round"], line["rc"]) for line in lines] == [("other", 1, 0), ("this", 1, 0)]
    for line in lines:
        assert list(line["stages"]) == ["data", "capture", "tasq", "kmeans", "finetune", "bundle"]
        assert 0 < sum(stage["wall_s"] for stage in line["stages"].values()) < line["command_s"]
        assert 0 < line["before_pipeline_s"] < line["command_s"] and 0 <= line["after_stages_s"] < line["command_s"]
    assert not work.exists()
