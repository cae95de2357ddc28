"""benchmarks/calibration/measure_real_command.sh, scaled down on the CPU: the real command timed end to end, one JSON
line per step with the code's identity, the run's stages and the seconds before its pipeline and after its last stage
(what docs/performance.md shows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from benchmarks.calibration import code_identity


@pytest.mark.slow  # about 25 s on 2 cores: a random checkpoint (Ouro-1.4B's shapes / 16) and a toy calibration
def test_a_scaled_down_run_records_the_command_its_code_and_its_stages(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "STEPS": "ouro-1.4b", "WORK": str(work), "PYTHON": sys.executable, "DEADLINE": "600"}
    toy = (
        "data.num_sequences=4",
        "data.heldout_sequences=1",
        "data.sequence_length=64",
        "quant.codebook_size=16",
        "quant.group_size=8",
        "kmeans.iterations=2",
        "finetune.epochs=1",
        "model.device=cpu",
    )
    small = [arg for kv in toy for arg in ("--set", kv)]
    done = subprocess.run(
        ["bash", "benchmarks/calibration/measure_real_command.sh", str(out), "16", *small],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == ["checkpoint-ouro-1.4b", "ouro-1.4b"]
    assert {line["code"] for line in lines} == {code_identity.tree_identity(ROOT)}
    run = lines[1]
    assert run["rc"] == 0 and run["sequences"] == 4 and run["seq_len"] == 64 and run["method"] == "tasq+loopvq"
    assert [name for name, stage in run["stages"].items() if stage["status"] == "done"] == [
        "data",
        "capture",
        "tasq",
        "kmeans",
        "finetune",
        "bundle",
    ]
    assert 0 < run["stages_s"] < run["command_s"] and run["before_pipeline_s"] > 0 and run["after_stages_s"] >= 0
    assert run["before_pipeline_s"] + run["stages_s"] + run["after_stages_s"] <= run["command_s"] + 0.05
    assert "stage bundle: done" in (out / "run-ouro-1.4b.log").read_text()
    assert not (work / "ouro-1.4b").exists() and not (work / "ouro-1.4b-random").exists()  # cleaned up
