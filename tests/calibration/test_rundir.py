"""The run directory's background deletion of large files (``discard``), and each stage's recorded peak GPU
memory, kept across the resets of the peak counters that fine-tuning makes for its own readings."""

from __future__ import annotations

import contextlib
import json
import threading

import pytest
import torch
from support.peak_counters import FakeCounters

from loopvq_calib.calibration import rundir
from loopvq_calib.calibration.finetune.loop_policy import release_cached_memory
from loopvq_calib.calibration.rundir import RunDir, discard
from loopvq_calib.runtime import device_memory
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


def test_the_fine_tuning_reset_inside_a_stage_does_not_lower_its_recorded_peak(tmp_path, monkeypatch):
    """Fake CUDA counters: a stage allocates 300, frees it, fine-tuning's start releases the cached memory and
    restarts the counters, then 50 more: the stage's record and manifest say 300; the next stage's say its own."""
    counters = FakeCounters()
    monkeypatch.setattr(device_memory.PEAKS, "counters", counters)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    run = RunDir(tmp_path / "run")
    run.open()
    with run.stage("finetune", "fp1") as (_, rec):
        counters.allocate(300)
        counters.allocate(-300)
        release_cached_memory(torch.device("cuda", 0))
        counters.allocate(50)
        assert counters.peak_allocated(torch.device("cuda", 0)) == 50  # the teacher cache's reading restarted
    with run.stage("export", "fp2") as (_, later):
        counters.allocate(20)
    run.close()
    stages = json.loads((run.root / "manifest.json").read_text())["stages"]
    assert rec.peak_gpu_bytes == 300 == stages["finetune"]["peak_gpu_bytes"]
    assert later.peak_gpu_bytes == 70 == stages["export"]["peak_gpu_bytes"]  # the 50 still held, and its own 20


@pytest.mark.gpu
def test_on_cuda_the_finetune_stage_records_its_peak_from_before_the_fine_tuning_reset(tmp_path):
    """Allocate X on the GPU, free it, reset through fine-tuning's path (release_cached_memory), allocate X / 4:
    CUDA's counter has restarted below X, the stage's record and manifest keep at least X."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    big = 256 << 20
    run = RunDir(tmp_path / "run")
    run.open()
    with run.stage("finetune", "fp") as (_, rec):
        base = torch.cuda.memory_allocated(cuda)
        held = torch.empty(big, dtype=torch.uint8, device=cuda)
        del held
        release_cached_memory(cuda)
        small = torch.empty(big // 4, dtype=torch.uint8, device=cuda)
        assert torch.cuda.max_memory_allocated(cuda) < base + big  # the counter restarted
        del small
    run.close()
    recorded = json.loads((run.root / "manifest.json").read_text())["stages"]["finetune"]["peak_gpu_bytes"]
    assert rec.peak_gpu_bytes >= base + big and recorded == rec.peak_gpu_bytes
