"""The run directory's background deletion of large files (``discard``)."""

from __future__ import annotations

import threading

from loopvq_calib.calibration import rundir
from loopvq_calib.calibration.rundir import RunDir, discard
from loopvq_calib.runtime.files import TMP_PREFIX


def test_a_discarded_file_leaves_its_folder_at_once_and_is_gone_when_the_run_closes(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run")
    run.open()
    stage = run.root / f"{TMP_PREFIX}finetune"
    stage.mkdir()
    (stage / "resume.pt").write_bytes(b"state" * 1000)
    release = threading.Event()
    real_unlink = type(stage).unlink
    monkeypatch.setattr(type(stage), "unlink", lambda path, **kw: release.wait(10) and real_unlink(path, **kw))
    discard(stage / "resume.pt", run.root)
    assert list(stage.iterdir()) == []  # renamed before the deletion starts: the stage folder can be published
    doomed = [p for p in run.root.iterdir() if p.name.startswith(f"{TMP_PREFIX}discarded.resume.pt.")]
    assert len(doomed) == 1 and doomed[0].read_bytes() == b"state" * 1000  # still being deleted
    release.set()
    run.close()  # waits for the deletion
    assert not doomed[0].exists() and run.root not in rundir._DISCARDING


def test_discarding_a_missing_file_does_nothing(tmp_path):
    discard(tmp_path / "resume.pt", tmp_path)
    assert list(tmp_path.iterdir()) == [] and tmp_path not in rundir._DISCARDING


def test_a_discarded_file_a_killed_run_left_is_removed_by_the_next_run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.open()
    run.close()
    left = run.root / f"{TMP_PREFIX}discarded.resume.pt.123.456"  # renamed, then the process died
    left.write_bytes(b"state")
    again = RunDir(tmp_path / "run")
    again.open()
    assert not left.exists() and (run.root / "manifest.json").is_file()
    again.close()


def test_a_failed_background_deletion_is_logged_and_left_for_the_next_run(tmp_path, monkeypatch, caplog):
    run = RunDir(tmp_path / "run")
    run.open()
    (run.root / "resume.pt").write_bytes(b"state")

    def refuse(path, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(run.root), "unlink", refuse)
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        discard(run.root / "resume.pt", run.root)
        run.close()
    left = [p for p in run.root.iterdir() if p.name.startswith(f"{TMP_PREFIX}discarded.")]
    assert len(left) == 1 and "could not delete" in caplog.text and "Permission denied" in caplog.text
    monkeypatch.undo()
    again = RunDir(tmp_path / "run")
    again.open()
    assert not left[0].exists()
    again.close()
