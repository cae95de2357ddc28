"""The manifest records every stage file's sha256, computed from the bytes as they were written; a rerun checks
sizes, then hashes, and runs a stage again (with a warning naming the file) whose file changed in place."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from support.builders import tiny_config

import loopvq_calib.calibration.rundir as rundir_module
from loopvq_calib.calibration.pipeline import calibrate
from loopvq_calib.calibration.rundir import MANIFEST, RunDir
from loopvq_calib.runtime.files import DIGEST_LOG, write_bytes_atomic


def records(run: Path) -> dict:
    return json.loads((run / MANIFEST).read_text())["stages"]


def reused(result) -> dict[str, bool]:
    return {s["name"]: s["reused"] for s in result.stages}


def flip_last_byte(path: Path) -> bytes:
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))  # the same size, other bytes
    return good


def test_every_stage_file_is_recorded_with_the_sha256_of_its_bytes(tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch):
    """The hashes of the data, capture, k-means and fine-tuning files come from their writes (reading a finished
    file back would fail here); the bundle's writer writes its files itself, so those are read once at publication."""
    read_back = []
    monkeypatch.setattr(rundir_module, "sha256_file", lambda path: read_back.append(Path(path).name) or "unused")
    run = calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"), stages=["finetune"]).run_dir
    assert read_back == []
    monkeypatch.undo()
    calibrate(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run"))
    stages = records(run)
    assert set(stages) == {"data", "capture", "kmeans", "finetune", "bundle"}
    for name, rec in stages.items():
        files = sorted(p for p in (run / name).rglob("*") if p.is_file())
        names = [str(p.relative_to(run / name)) for p in files]
        assert files and sorted(rec["files"]) == sorted(rec["sha256"]) == names
        for path in files:
            rel = str(path.relative_to(run / name))
            assert rec["sha256"][rel] == hashlib.sha256(path.read_bytes()).hexdigest(), f"{name}/{rel}"
            assert rec["files"][rel] == len(path.read_bytes())
    assert not list(run.rglob(DIGEST_LOG)) and not list(run.glob(".loopvq-tmp.*"))


def new_log_lines(run: Path, seen: list[str]) -> str:
    """The lines ``run.log`` gained since the last call (the run logs there, not to the root logger)."""
    lines = (run / "run.log").read_text().splitlines()
    new, seen[:] = lines[len(seen) :], lines
    return "\n".join(new)


def test_a_file_corrupted_in_place_at_its_size_reruns_its_stage_with_a_warning(tiny_ouro_dir, calib_corpus, tmp_path):
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    run = calibrate(cfg, stages=["kmeans"]).run_dir
    seen: list[str] = []
    assert "WARNING" not in new_log_lines(run, seen)
    shard = run / "capture" / "seq00002.safetensors"
    good = flip_last_byte(shard)
    again = calibrate(cfg, stages=["kmeans"])
    assert reused(again) == {"data": True, "capture": False, "kmeans": True}  # the same capture: k-means reused
    warnings = [line for line in new_log_lines(run, seen).splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        f"stage capture: {shard} changed since the stage finished (its sha256 differs from the manifest's); running it "
        "again"
    )
    assert shard.read_bytes() == good
    assert records(run)["capture"]["sha256"][shard.name] == hashlib.sha256(good).hexdigest()
    assert all(reused(calibrate(cfg, stages=["kmeans"])).values())
    assert "WARNING" not in new_log_lines(run, seen)


def test_a_reused_data_stage_is_hashed_once_per_run_and_warned_about_once(
    tiny_ouro_dir, calib_corpus, tmp_path, monkeypatch
):
    """The run's checks (before the directory is opened) and the stage itself share one reuse check while the
    manifest's record stays the same: each file is read once, and a changed one is named once."""
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    run = calibrate(cfg, stages=["data"]).run_dir
    files = sorted(records(run)["data"]["sha256"])
    hashed = []
    real = rundir_module.sha256_file
    monkeypatch.setattr(rundir_module, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    assert reused(calibrate(cfg, stages=["data"])) == {"data": True}
    assert sorted(hashed) == files  # each once
    seen: list[str] = []
    new_log_lines(run, seen)
    flip_last_byte(run / "data" / files[0])
    hashed.clear()
    assert reused(calibrate(cfg, stages=["data"])) == {"data": False}
    assert hashed.count(files[0]) == 1
    warnings = [line for line in new_log_lines(run, seen).splitlines() if "WARNING" in line]
    assert (
        len(warnings) == 1 and f"stage data: {run / 'data' / files[0]} changed since the stage finished" in warnings[0]
    )


def test_a_manifest_without_hashes_is_checked_by_size(tiny_ouro_dir, calib_corpus, tmp_path):
    """A manifest of an older toolkit records sizes only: its stages are reused while their sizes match (a same-size
    change goes unnoticed until the stage runs again, which records the hashes), and rerun when a size differs."""
    cfg = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")
    run = calibrate(cfg, stages=["capture"]).run_dir
    manifest = json.loads((run / MANIFEST).read_text())
    for rec in manifest["stages"].values():
        del rec["sha256"]
    (run / MANIFEST).write_text(json.dumps(manifest))
    flip_last_byte(run / "capture" / "seq00000.safetensors")
    seen: list[str] = []
    new_log_lines(run, seen)
    assert reused(calibrate(cfg, stages=["capture"])) == {"data": True, "capture": True}
    assert "WARNING" not in new_log_lines(run, seen) and all("sha256" not in rec for rec in records(run).values())
    (run / "capture" / "seq00001.safetensors").write_bytes(b"short")
    assert reused(calibrate(cfg, stages=["capture"])) == {"data": True, "capture": False}
    assert set(records(run)["capture"]["sha256"]) == set(records(run)["capture"]["files"])


def test_a_resumed_stage_records_the_digests_its_earlier_run_logged(tmp_path):
    """A resumable stage's temporary folder keeps the digest log of the files an interrupted run wrote."""
    run = RunDir(tmp_path / "run")
    run.open()
    try:
        with run.stage("capture", "fp", resumable=True) as (folder, _):
            write_bytes_atomic(folder / "seq0.bin", b"first run")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert (run.root / ".loopvq-tmp.capture" / DIGEST_LOG).is_file()
    with run.stage("capture", "fp", resumable=True) as (folder, _):
        assert (folder / "seq0.bin").is_file()  # kept: not written again
        write_bytes_atomic(folder / "seq1.bin", b"second run")
    run.close()
    rec = records(run.root)["capture"]
    assert rec["sha256"] == {
        name: hashlib.sha256(data).hexdigest()
        for name, data in (("seq0.bin", b"first run"), ("seq1.bin", b"second run"))
    }
