"""The staged run after a crash: nothing left that a rerun mistakes for a result, damaged stage files rerun their
stage, an interrupted disk capture resumes after the sequences it wrote and fine-tuning after its last epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.builders import tiny_config

import loopvq_calib.calibration.stages as stages_module
from loopvq_calib.calibration.pipeline import calibrate


def statuses(run: Path) -> dict[str, str]:
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    return {k: v["status"] for k, v in stages.items()}


def test_crash_leaves_nothing_a_rerun_mistakes_for_a_result(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, out)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash in fine-tuning")

    monkeypatch.setattr(stages_module, "finetune_codebooks", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        calibrate(cfg)
    assert statuses(out)["finetune"] == "failed" and not (out / "finetune").exists()
    # fine-tuning resumes after its last finished epoch: its temporary folder stays, marked, holding no result
    assert [p.name for p in out.glob(".loopvq-tmp.*")] == [".loopvq-tmp.finetune"]
    assert [p.name for p in (out / ".loopvq-tmp.finetune").iterdir()] == [".loopvq-resume"]
    monkeypatch.undo()

    # a process killed mid-stage leaves its temporary folder and a "running" record: neither is reused
    (out / ".loopvq-tmp.finetune" / "quantizer.json").write_text("{partial")
    resumed = calibrate(cfg)
    assert {s["name"]: s["reused"] for s in resumed.stages} == {
        "data": True,
        "capture": True,
        "kmeans": True,
        "finetune": False,
        "bundle": False,
    }
    assert statuses(out) == dict.fromkeys(["data", "capture", "kmeans", "finetune", "bundle"], "done")
    assert not (out / ".loopvq-tmp.finetune").exists()


def test_damaged_stage_files_rerun_the_stage(tiny_ouro_dir, calib_corpus, tmp_path):
    """A truncated or deleted file of a finished stage is noticed (recorded sizes) and the stage runs again."""
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    run = calibrate(cfg, stages=["capture", "kmeans"]).run_dir
    shard = run / "capture" / "seq00001.safetensors"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    (run / "kmeans" / "report.json").unlink()
    again = calibrate(cfg, stages=["capture", "kmeans"])
    assert {s["name"]: s["reused"] for s in again.stages} == {"data": True, "capture": False, "kmeans": False}
    assert shard.read_bytes() == good  # the capture is deterministic: the same shard again


def test_an_interrupted_disk_capture_resumes_after_the_sequences_it_wrote(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch
):
    """Within-stage resume: a capture stopped in its 4th sequence keeps its 3 finished shards; the rerun (same
    fingerprint) captures only the other 3 and publishes shards byte-identical to an uninterrupted run's."""
    import loopvq_calib.calibration.capture.kv as capture

    clean = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "clean"), stages=["capture"]).run_dir
    real, calls = capture.capture_sequence, []

    def counted(model, ids, kv, *, seqs, **kwargs):
        calls.append(list(seqs))
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt  # Ctrl-C (a kill -9 leaves the same folder, without the failed record)
        return real(model, ids, kv, seqs=seqs, **kwargs)

    monkeypatch.setattr(capture, "capture_sequence", counted)
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    stop_at = 4
    with pytest.raises(KeyboardInterrupt):
        calibrate(cfg, stages=["capture"])
    assert statuses(tmp_path / "run")["capture"] == "failed"
    calls.clear()
    stop_at = None
    run = calibrate(cfg, stages=["capture"]).run_dir
    assert calls == [[3], [4], [5]]
    shards = sorted(p.name for p in (clean / "capture").glob("seq*.safetensors"))
    assert shards == sorted(p.name for p in (run / "capture").glob("seq*.safetensors")) and len(shards) == 6
    for name in shards:
        assert (run / "capture" / name).read_bytes() == (clean / "capture" / name).read_bytes(), name
    assert not list(run.glob(".loopvq-tmp.*")) and not (run / "capture" / ".loopvq-resume").exists()
    calls.clear()
    changed = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", capture={"dtype": "float32"})
    calibrate(changed, stages=["capture"])  # another fingerprint: everything is captured again
    assert calls == [[i] for i in range(6)]


def test_an_interrupted_finetune_resumes_after_its_last_epoch(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """Within-stage resume: fine-tuning stopped in its 2nd epoch restarts from the state saved after the 1st
    (parameters, Adam's moments, curve) and gives the codebooks and curve of an uninterrupted run."""
    import loopvq_calib.calibration.finetune.train as finetune

    clean = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "clean"), stages=["finetune"]).run_dir
    real, calls = finetune.sequence_kl, []

    def counted(*args, **kwargs):
        calls.append(1)
        if stop_at is not None and len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(finetune, "sequence_kl", counted)
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    # initial selection (2 sequences, one forward), epoch 1 (4 steps + selection), 2 steps of epoch 2
    stop_at = 1 + 4 + 1 + 2
    with pytest.raises(KeyboardInterrupt):
        calibrate(cfg, stages=["finetune"])
    calls.clear()
    stop_at = None
    run = calibrate(cfg, stages=["finetune"]).run_dir
    assert len(calls) == 4 + 1  # epoch 2 only: its 4 steps and its selection
    for name in ("quantizer.safetensors", "curve.json"):
        assert (run / "finetune" / name).read_bytes() == (clean / "finetune" / name).read_bytes(), name
    assert not (run / "finetune" / "resume.pt").exists() and not list(run.glob(".loopvq-tmp.*"))
