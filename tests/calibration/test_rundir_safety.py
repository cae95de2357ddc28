"""No content of a run directory makes the toolkit touch anything outside it: manifest entries that lead out
(absolute, ``..``, through a symbolic link) stop the run before anything is deleted, and the lock and the run's
own files are never written through a link."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from support.builders import tiny_config

from loopvq_calib.calibration.run_lock import LOCK_FILE, RunLock, RunLockError
from loopvq_calib.calibration.rundir import MANIFEST, RunDir, RunDirError, check_output_folder
from loopvq_calib.cli import calibrate_main


def add_entry(run: Path, stage: str, entry: str, size: int = 1) -> None:
    manifest = json.loads((run / MANIFEST).read_text())
    manifest["stages"][stage]["files"][entry] = size
    (run / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def data_run(tiny_ouro_dir, calib_corpus, tmp_path) -> tuple[Path, list[str]]:
    """A run directory holding a finished data stage, and the arguments that rerun that stage (another seed)."""
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run")))
    assert calibrate_main(["--config", str(cfg_path), "--stages", "data"]) == 0
    return tmp_path / "run", ["--config", str(cfg_path), "--set", "data.seed=1", "--stages", "data"]


@pytest.mark.parametrize("kind", ["parent", "absolute"])
def test_a_manifest_entry_outside_its_folder_stops_the_run_before_anything_is_deleted(data_run, tmp_path, capsys, kind):
    run, rerun = data_run
    precious = tmp_path / "notes.txt"  # beside the run directory, one level above the stage folder's parent
    precious.write_text("mine")
    entry = "../../notes.txt" if kind == "parent" else str(precious)
    add_entry(run, "data", entry, size=4)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert calibrate_main(rerun) == 2
    err = capsys.readouterr().err
    # the entry is named (a long one cut short in the middle: its start stays)
    assert f"{run / MANIFEST}: stage 'data' lists {entry[:16]!r}"[:-1] in err and "Traceback" not in err
    assert precious.read_text() == "mine" and sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_an_entry_that_is_a_link_out_of_the_folder_is_refused(data_run, tmp_path):
    run, _ = data_run
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (run / "data" / "link.txt").symlink_to(precious)
    add_entry(run, "data", "link.txt", size=4)
    with pytest.raises(
        RunDirError,
        match=r"manifest\.json: stage 'data' lists 'link.txt', a path that leads out of "
        r".*/run/data through a symbolic link",
    ):
        RunDir(run, stage_names=("data",))
    assert precious.read_text() == "mine"


def test_entries_are_checked_again_before_the_stage_is_replaced_and_before_its_first_deletion(tmp_path):
    """An entry that leads out, appearing after the manifest was read, stops the stage's publication before any
    of its files is deleted: neither the user's file nor the stage's own earlier files are touched."""
    run = RunDir(tmp_path / "run")
    run.open()
    with run.stage("data", "fp1") as (folder, _):
        (folder / "a.txt").write_text("stage")
    precious = tmp_path / "notes.txt"
    precious.write_text("mine")
    run.manifest["stages"]["data"]["files"]["../../notes.txt"] = 4
    with pytest.raises(
        RunDirError,
        match=r"stage 'data' lists '\.\./\.\./notes.txt', not the name of a file inside "
        r".*/run/data",
    ):
        with run.stage("data", "fp2") as (folder, _):
            (folder / "a.txt").write_text("again")
    run.close()
    assert precious.read_text() == "mine" and (run.root / "data" / "a.txt").read_text() == "stage"
    assert not list(run.root.glob(".loopvq-tmp.*"))


def test_an_entry_that_is_a_folder_is_refused_when_read_and_before_the_first_deletion(tmp_path):
    """A recorded name that is a folder (or a link) stops the run: when the manifest is read, and, when it becomes one
    after that, before any of the stage's files is deleted (deletion goes in the record's order)."""
    run = RunDir(tmp_path / "run")
    run.open()
    with run.stage("data", "fp1") as (folder, _):
        for name in ("a.txt", "b.txt", "c.txt"):
            (folder / name).write_text(name)
    (run.root / "data" / "b.txt").unlink()
    (run.root / "data" / "b.txt").mkdir()
    with pytest.raises(
        RunDirError,
        match=re.escape(
            f"{run.root / MANIFEST}: stage 'data' lists 'b.txt', which is a "
            f"folder in {run.root / 'data'}, not a file the toolkit wrote"
        ),
    ):
        RunDir(run.root)
    with pytest.raises(RunDirError, match=r"stage 'data' lists 'b\.txt', which is a folder .*; nothing was deleted"):
        with run.stage("data", "fp2") as (folder, _):
            (folder / "a.txt").write_text("again")
    run.close()
    assert [(p.name, p.is_file()) for p in sorted((run.root / "data").iterdir())] == [
        ("a.txt", True),
        ("b.txt", False),
        ("c.txt", True),
    ]
    assert (run.root / "data" / "a.txt").read_text() == "a.txt" and not list(run.root.glob(".loopvq-tmp.*"))


def test_a_manifest_nested_too_deeply_names_the_file(tmp_path):
    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(RunDirError, match=re.escape(f"{tmp_path / MANIFEST} is nested too deeply to read")):
        RunDir(tmp_path)


def test_a_subfolder_linked_out_of_a_stage_is_never_entered(tmp_path):
    run = RunDir(tmp_path / "run")
    run.open()
    with run.stage("data", "fp1") as (folder, _):
        (folder / "sub").mkdir()
        (folder / "sub" / "x.txt").write_text("stage")
    user = tmp_path / "user"
    user.mkdir()
    (user / "x.txt").write_text("mine")
    (run.root / "data" / "sub" / "x.txt").unlink()
    (run.root / "data" / "sub").rmdir()
    (run.root / "data" / "sub").symlink_to(user, target_is_directory=True)
    with pytest.raises(
        RunDirError, match=r"lists 'sub/x.txt', a path that leads out of .*/run/data through a symbolic"
    ):
        RunDir(run.root)
    with pytest.raises(RunDirError, match=r"data holds files this toolkit did not write \(sub\)"):
        with run.stage("data", "fp2"):
            pass
    run.close()
    assert (user / "x.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"../up": {"fingerprint": "f", "status": "done"}}, "stage entry '../up' is not a stage record"),
        ({"data": {"status": "done", "files": ["a"]}}, "stage 'data' has a 'files' or 'sha256' entry that is not a"),
        ({"data": {"status": "done", "files": {"a": "1"}}}, "stage 'data' has a 'files' or 'sha256' entry"),
        ({"data": {"status": "done", "files": {}, "sha256": {"../a": "00"}}}, "stage 'data' lists '../a'"),
        ({"data": {"status": "done", "files": {"": 1}}}, "stage 'data' lists '', not the name of a file inside"),
    ],
)
def test_a_manifest_whose_records_are_not_the_toolkits_is_refused(tmp_path, record, message):
    (tmp_path / MANIFEST).write_text(json.dumps({"stages": record}))
    with pytest.raises(RunDirError, match=re.escape(f"{tmp_path / MANIFEST}: {message}")):
        RunDir(tmp_path)


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    target = tmp_path / "thesis.txt"
    target.write_text("years of work")
    run = tmp_path / "run"
    run.mkdir()
    (run / MANIFEST).write_text('{"stages": {}}')
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(RunDirError, match=f"{run / LOCK_FILE} is a symbolic link"):
        RunDir(run)
    with pytest.raises(RunLockError, match=f"{run / LOCK_FILE} is a symbolic link"):  # the open itself follows none
        RunLock.acquire(run)
    assert target.read_text() == "years of work"


def test_a_lock_file_that_is_a_hard_link_is_refused_and_its_contents_kept(tmp_path):
    target = tmp_path / "thesis.txt"
    target.write_text("years of work")
    os.link(target, tmp_path / LOCK_FILE)
    with pytest.raises(RunLockError, match="is a hard link to another file"):
        RunLock.acquire(tmp_path)
    assert target.read_text() == "years of work"


@pytest.mark.parametrize("name", [LOCK_FILE, ".loopvq-tmp.data"])
def test_an_output_folder_holding_only_a_link_is_not_empty(tmp_path, name):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / name).symlink_to(tmp_path)
    with pytest.raises(RunDirError, match=f"is not empty and is not a loopvq-calibrate run directory .* holds {name}"):
        check_output_folder(folder)
    (folder / name).unlink()
    (folder / LOCK_FILE).write_text("")  # the toolkit's own lock file does not count
    check_output_folder(folder)


@pytest.mark.parametrize("name", ["run.log", "config.yaml", MANIFEST])
def test_the_runs_own_files_are_never_written_through_a_link(tmp_path, name):
    target = tmp_path / "mine.txt"
    target.write_text("mine")
    run = tmp_path / "run"
    run.mkdir()
    if name != MANIFEST:
        (run / MANIFEST).write_text('{"stages": {}}')
    (run / name).symlink_to(target)
    with pytest.raises(RunDirError, match=f"{run / name} is a symbolic link; the run writes this file itself"):
        RunDir(run)
    assert target.read_text() == "mine"
