"""The fuzz table (tests/test_fuzz.py), output folders, run directories and locks: a file or a user's folder as the
output, user files in a stage, manifests broken, too deep or naming entries outside the stage or a folder, a run
holding the lock, the lock as a link. Each case exits 2, naming it in one short line, and writes and deletes nothing
(support/fuzz.py). Then a real second process holding the lock, and user files that survive reruns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from support.fuzz import (
    DEEP,
    Case,
    assert_refused,
    case_ids,
    hold_lock,
    linked_lock,
    manifest_entry,
    manifest_folder_entry,
    output_holding_a_link,
    snapshot,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib.calibration.rundir import LOCK_FILE
from loopvq_calib.cli import calibrate_main

CASES: list[Case] = [
    # -- output folders, run directories, locks --------------------------------------------------------
    (
        "output-is-a-file",
        lambda ws: ws.run_with("--output", ws.file("afile", "x")),
        2,
        "afile exists and is not a directory",
    ),
    (
        "output-user-folder",
        lambda ws: ws.run_with("--output", str(Path(ws.file("P/data/train.csv", "x")).parents[1]), "--stages", "data"),
        2,
        "is not empty and is not a loopvq-calibrate run directory",
    ),
    (
        "output-user-tmp-folder",
        lambda ws: ws.run_with("--output", str(Path(ws.file("Q/.backup.tmp/thesis.txt", "x")).parents[1])),
        2,
        "holds .backup.tmp",
    ),
    (
        "output-under-a-file",
        lambda ws: ws.run_with("--output", ws.file("afile", "x") + "/sub"),
        2,
        "output.dir: cannot use",
    ),
    (
        "rundir-user-file-in-stage",
        lambda ws: (ws.run_dir({"data/mine.csv": "x"}), ws.run_with("--stages", "data"))[1],
        2,
        "holds files this toolkit did not write (mine.csv)",
    ),
    (
        "rundir-user-folder-as-stage",
        lambda ws: (ws.run_dir({"capture/notes.txt": "x"}), ws.run_with("--stages", "capture"))[1],
        2,
        "run/capture holds files this toolkit did not write (notes.txt)",
    ),
    (
        "rundir-bad-manifest",
        lambda ws: (ws.run_dir({"manifest.json": "{"}), ws.run_with())[1],
        2,
        "manifest.json is not valid JSON",
    ),
    ("rundir-locked", hold_lock, 2, "is in use by another loopvq-calibrate run (pid"),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    (
        "manifest-entry-dotdot",
        lambda ws: manifest_entry(ws, "../../notes.txt"),
        2,
        "lists '../../notes.txt', not the name of a file inside {}/run/data",
    ),
    (
        "manifest-entry-absolute",
        lambda ws: manifest_entry(ws, "{}/notes.txt"),
        2,
        "notes.txt', an absolute path, not a file of {}/run/data",
    ),
    ("lock-is-a-symlink", linked_lock, 2, f"run/{LOCK_FILE} is a symbolic link"),
    (
        "output-holds-only-a-link",
        output_holding_a_link,
        2,
        "{}/out is not empty and is not a loopvq-calibrate run directory (no manifest.json; it holds link)",
    ),
    # -- what a file or a value can say: run directories -----------------------------------------------
    (
        "rundir-manifest-too-deep",
        lambda ws: (ws.run_dir({"manifest.json": DEEP}), ws.run_with())[1],
        2,
        "{}/run/manifest.json is nested too deeply to read",
    ),
    (
        "manifest-entry-is-a-folder",
        manifest_folder_entry,
        2,
        "stage 'data' lists 'sub', which is a folder in {}/run/data, not a file the toolkit wrote; nothing was deleted",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)


def test_a_second_process_holding_the_lock_is_named_and_a_killed_ones_lock_is_taken_over(ws, capsys, caplog):
    """A real second run: refused at once naming its pid and host; once it is killed, its lock is taken over."""
    run = ws.run_dir()
    holder = (
        "import sys, time; from pathlib import Path; from loopvq_calib.calibration.rundir import RunDir\n"
        "r = RunDir(Path(sys.argv[1])); r.open(); print('locked', flush=True); time.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = snapshot(ws.root)
        capsys.readouterr()
        assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another loopvq-calibrate run (pid {proc.pid} on host {os.uname().nodename}" in err
        assert snapshot(ws.root) == before
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid  # the dead run's record stays
    assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 0
    log = (run / "run.log").read_text()
    assert log.count(f"took over the lock of a run that is no longer running (pid {proc.pid}") == 1
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly: no holder recorded
    assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 0
    assert (run / "run.log").read_text().count("took over the lock") == 1  # a clean exit leaves nothing to take over


def test_user_files_beside_and_inside_a_run_directory_survive_reruns(ws):
    """Files the toolkit did not write are never deleted: beside the stages, in hidden *.tmp folders."""
    run = ws.run_dir({"notes.txt": "mine", ".backup.tmp/thesis.txt": "chapter 1", ".data.tmp/keep": "k"})
    assert calibrate_main(["--config", ws.config(), "--stages", "data", "--set", "data.seed=1"]) == 0  # reruns data
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / ".backup.tmp" / "thesis.txt").read_text() == "chapter 1"
    assert (run / ".data.tmp" / "keep").read_text() == "k"
    assert not list(run.glob(".loopvq-tmp.*"))
