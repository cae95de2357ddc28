"""The epoch state writer: a host copy written in the background, atomic replacement, errors handed over,
pinned host buffers reused across saves (CUDA) and the unchanged entries' copies reused."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.calibration.finetune.epoch_state import EpochWriter
from loopvq_calib.runtime.files import TMP_PREFIX


def test_epoch_writer_saves_a_host_copy_in_the_background_and_replaces_atomically(tmp_path):
    """The state is copied before training changes it, lands on the host, and a failed write leaves the previous
    file intact and is raised (naming the cause) by the next save or close."""
    path = tmp_path / "resume.pt"
    params = torch.arange(4.0)
    writer = EpochWriter(path)
    writer.save({"epoch": 1, "params": [params], "curve": [{"step": 0}]})
    params += 100  # training goes on while the file is written
    writer.close()
    saved = torch.load(path, weights_only=False)
    assert torch.equal(saved["params"][0], torch.arange(4.0)) and saved["params"][0].device.type == "cpu"
    assert saved["epoch"] == 1 and saved["curve"] == [{"step": 0}]
    before = path.read_bytes()

    writer.save({"epoch": 2, "unpicklable": lambda: None})  # torch.save cannot pickle a lambda
    with pytest.raises(Exception, match="lambda|pickle"):
        writer.close()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["resume.pt"]
    writer.close()  # the error was handed over once


def test_epoch_writer_removes_orphans_and_lets_the_training_error_win(tmp_path, caplog):
    """A killed run's temporary beside the state file is removed; when training raises while a write fails, the
    training error propagates and the write error is logged."""
    path = tmp_path / "resume.pt"
    orphan, other = tmp_path / f"{TMP_PREFIX}resume.pt.123", tmp_path / f"{TMP_PREFIX}resume.pt-other.123"
    for left in (orphan, other):
        left.write_bytes(b"half")
    with pytest.raises(KeyError, match="training"):
        with EpochWriter(path) as writer:
            assert not orphan.exists() and other.exists()  # only the state file's own temporaries
            writer.save({"unpicklable": lambda: None})
            raise KeyError("training")
    assert "could not be written" in caplog.text and not path.exists() and not orphan.exists()


def test_unchanged_entries_are_written_from_the_previous_copy(tmp_path):
    """An entry the caller names unchanged is not copied again: its previous host copy is written (so a tensor
    changed behind the writer's back shows that it was not re-read); the others are copied afresh."""
    path = tmp_path / "resume.pt"
    best, params = torch.arange(3.0), torch.zeros(2)
    with EpochWriter(path) as writer:
        writer.save({"best_state": {"a": best}, "params": [params]})
        best += 10
        params += 1
        writer.save({"best_state": {"a": best}, "params": [params]}, unchanged=("best_state",))
        writer.close()
        saved = torch.load(path, weights_only=False)
        assert torch.equal(saved["best_state"]["a"], torch.arange(3.0))
        assert torch.equal(saved["params"][0], torch.ones(2))
        writer.save({"best_state": {"a": best}, "params": [params]})
    saved = torch.load(path, weights_only=False)
    assert torch.equal(saved["best_state"]["a"], torch.arange(3.0) + 10)


@pytest.mark.gpu
def test_cuda_state_goes_through_reused_pinned_buffers_without_waiting(tmp_path):
    """CUDA tensors are copied into pinned host buffers that ``prepare`` allocated (in its thread) and every save
    reuses; the copies are queued on the current stream, so work queued after the save (here an in-place change)
    does not reach the file, and the file equals a plain host copy."""
    cuda = torch.device("cuda")
    path = tmp_path / "resume.pt"
    moments = torch.randn(1 << 20, device=cuda)
    best = {"k": torch.randn(256, 16, device=cuda, dtype=torch.bfloat16)}
    step = torch.tensor(3.0)  # Adam's step count stays on the host
    with EpochWriter(path) as writer:
        writer.prepare({"epoch": 0, "opt": {"state": {0: {"exp_avg": moments, "step": step}}}, "best_state": best})
        writer.close()  # waits for the allocation too
        buffers = {k: b.data_ptr() for k, b in writer._buffers.items()}
        assert all(b.is_pinned() for b in writer._buffers.values()) and len(buffers) == 2
        for epoch in (1, 2):
            expected = moments.cpu()
            writer.save(
                {"epoch": epoch, "opt": {"state": {0: {"exp_avg": moments, "step": step}}}, "best_state": best},
                unchanged=("best_state",) if epoch == 2 else (),
            )
            moments.mul_(2)  # queued after the copy on the same stream
            writer.close()
            saved = torch.load(path, weights_only=False)
            assert saved["epoch"] == epoch and torch.equal(saved["opt"]["state"][0]["exp_avg"], expected)
            assert torch.equal(saved["opt"]["state"][0]["step"], step)
            assert torch.equal(saved["best_state"]["k"], best["k"].cpu())
        assert {k: b.data_ptr() for k, b in writer._buffers.items()} == buffers  # reused, none added
