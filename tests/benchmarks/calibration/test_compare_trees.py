"""benchmarks/calibration/compare_trees.sh: the other tree first in every round, each run's line read from its
manifest (stage seconds and peak bytes, the seconds before the pipeline and after its last stage, against the values
the run wrote), nothing left in its work folder. A stand-in interpreter plays the checkpoint maker and the calibration,
which write a known manifest; the script's own recorder runs in the real one (the manifest's fields are the real
command's: test_measure_real_command.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT

# python for the script: `-m loopvq_calib ... --output DIR` writes DIR/manifest.json as a run does (the pipeline
# entered 0.2 s after the start, its last stage done at 0.4 s, the exit at 0.8 s) and names its tree in ORDER; the
# checkpoint maker does nothing; the script's recorder (`python - ...`) runs in the real interpreter
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-m" ]; then
  out=$(printf '%s\\n' "$@" | grep -A1 -x -- --output | tail -1)
  mkdir -p "$out" && pwd >> "$ORDER"
  exec "$REAL" -c '
import json, sys, time
start = time.time()
time.sleep(0.5)
stages = {"capture": {"wall_s": 0.125, "peak_gpu_bytes": 3}, "kmeans": {"wall_s": 0.25, "peak_gpu_bytes": None}}
manifest = {"startup": {"entered_at": start + 0.2}, "stages": stages, "stages_done_at": start + 0.4}
open(sys.argv[1] + "/manifest.json", "w").write(json.dumps(manifest))
time.sleep(0.3)' "$out"
fi
case "$1" in *make_random_checkpoint.py) exit 0 ;; esac
exec "$REAL" "$@"
"""


def test_the_other_tree_goes_first_and_each_line_holds_its_runs_manifest(tmp_path):
    out, work, other, order = tmp_path / "out", tmp_path / "work", tmp_path / "other", tmp_path / "order.txt"
    other.mkdir()
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    env = {**os.environ, "WORK": str(work), "PYTHON": str(python), "REAL": sys.executable, "ORDER": str(order)}
    done = subprocess.run(
        ["bash", "benchmarks/calibration/compare_trees.sh", str(out), str(other), "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert order.read_text().split() == [str(other), str(ROOT)] * 2  # B A B A: the other tree first
    lines = [json.loads(line) for line in (out / "compare.jsonl").read_text().splitlines()]
    assert [(line["tree"], line["round"], line["rc"]) for line in lines] == [
        ("other", 1, 0),
        ("this", 1, 0),
        ("other", 2, 0),
        ("this", 2, 0),
    ]
    for line in lines:
        assert line["stages"] == {
            "capture": {"wall_s": 0.12, "peak_gpu_bytes": 3},  # rounded to 2 places
            "kmeans": {"wall_s": 0.25, "peak_gpu_bytes": None},
        }
        assert line["before_pipeline_s"] >= 0.2 and line["after_stages_s"] >= 0.4  # and the interpreter's start
        between = line["command_s"] - line["before_pipeline_s"] - line["after_stages_s"]
        assert abs(between - 0.2) < 0.02  # from the pipeline's entry to its last stage, to the rounding
    assert not work.exists()
