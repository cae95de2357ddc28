"""scripts/pyspy_summary.py: a py-spy raw profile's main-thread seconds split into imports, set-up and stages."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "pyspy_summary.py"
MAIN = "thread (7): MainThread;<module> (loopvq_calib/__main__.py:5)"
RAW = "\n".join([
    f"{MAIN};_find_and_load (<frozen importlib._bootstrap>:1360);<module> (torch/__init__.py:1) 30",
    f"{MAIN};Pipeline.__init__ (loopvq_calib/pipeline.py:98);mem_get_info (torch/cuda/memory.py:842) 5",
    f"{MAIN};Pipeline.stage_capture (loopvq_calib/pipeline.py:190);capture_sequence (loopvq_calib/capture.py:83);"
    "_engine_run_backward (torch/autograd/graph.py:869) 20",
    f"{MAIN};Pipeline.stage_capture (loopvq_calib/pipeline.py:190);rotate (loopvq_calib/models/common.py:78) 10",
    f"{MAIN};Pipeline.stage_kmeans (loopvq_calib/pipeline.py:231);_lloyd (loopvq_calib/kmeans_backends.py:273) 15",
    "thread (9): loopvq-warmup_0;warm_linalg (loopvq_calib/warmup.py:71) 99",  # not the main thread
]) + "\n"


def test_main_thread_seconds_by_part_and_the_heaviest_frames_of_a_stage(tmp_path):
    profile = tmp_path / "prof.txt.gz"
    with gzip.open(profile, "wt") as f:
        f.write(RAW)
    out = subprocess.run([sys.executable, str(SCRIPT), str(profile), "--rate", "10", "--top", "1"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    lines = [json.loads(line) for line in out]
    assert {k: v for k, v in lines[0].items() if k != "profile"} == {
        "main_thread_s": 8.0, "imports": 3.0, "capture": 3.0, "kmeans": 1.5, "pipeline_init": 0.5}
    stages = {line["stage"]: line for line in lines[1:]}
    assert list(stages) == ["capture", "tasq", "kmeans", "finetune", "bundle"]
    assert stages["capture"]["heaviest"] == [["capture_sequence capture.py:83 | _engine_run_backward graph.py:869", 2.0]]
    assert stages["tasq"] == {"stage": "tasq", "seconds": 0.0, "heaviest": []}
