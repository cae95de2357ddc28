"""Attaching an evaluation report to a bundle's card never leaves a torn bundle: a write failing midway or a
failed rename keeps the old card and loopvq.json (the same file, nothing left over), a stale card set aside by a
killed attempt is never restored, and write_bytes_atomic replaces a file whole or not at all."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from support.eval_reports import eval_report
from support.golden import (
    bundle_dir,  # noqa: F401 (the fixture)
    bundle_files,
)

from loopvq_calib.bundle.card import _replace_pair, attach_eval_report
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.runtime.files import TMP_PREFIX, write_bytes_atomic, write_json_atomic


@pytest.mark.parametrize("failing_write", [1, 2])  # 1: the new README.md, 2: the new loopvq.json
def test_attach_eval_report_failing_mid_write_leaves_the_old_bundle(bundle_dir, tmp_path, monkeypatch, failing_write):
    (tmp_path / "report.json").write_text(json.dumps(eval_report(load_bundle(bundle_dir).meta)))
    before = bundle_files(bundle_dir)
    real_fsync, calls = os.fsync, []

    def disk_full(fd):  # half the file reaches the disk, then the flush fails
        calls.append(fd)
        if len(calls) == failing_write:
            os.ftruncate(fd, os.fstat(fd).st_size // 2)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        attach_eval_report(bundle_dir, tmp_path / "report.json")
    assert len(calls) == failing_write
    assert bundle_files(bundle_dir) == before  # same files, same bytes, no temporary left behind
    load_bundle(bundle_dir)


@pytest.mark.parametrize("failing", ["loopvq.json", "README.md"])  # the new manifest's rename, the new card's
def test_attach_eval_report_failing_rename_of_the_manifest_restores_the_card(
    bundle_dir, tmp_path, monkeypatch, failing
):
    """The old card is moved aside and renamed back (the same file, not a rewritten copy); nothing is left over."""
    (tmp_path / "report.json").write_text(json.dumps(eval_report(load_bundle(bundle_dir).meta)))
    before, card_inode = bundle_files(bundle_dir), (bundle_dir / "README.md").stat().st_ino
    real_replace, failed = os.replace, []

    def replace(src, dst):  # the first rename onto ``failing`` from a temporary file fails, the others succeed
        if Path(dst).name == failing and Path(src).name.startswith(".loopvq-tmp.") and not failed:
            failed.append(src)
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        attach_eval_report(bundle_dir, tmp_path / "report.json")
    monkeypatch.undo()
    assert bundle_files(bundle_dir) == before and (bundle_dir / "README.md").stat().st_ino == card_inode
    load_bundle(bundle_dir)


def test_failing_first_rename_never_restores_a_stale_aside_card(tmp_path, monkeypatch):
    """When moving the old card aside fails, a file a killed attempt left at the aside name stays where it is:
    README.md keeps the old card, not the stale one."""
    for name, text in (
        ("README.md", "old card"),
        ("loopvq.json", "old meta"),
        ("card.tmp", "new card"),
        ("meta.tmp", "new meta"),
        (f"{TMP_PREFIX}README.md.old.{os.getpid()}", "stale card"),
    ):
        (tmp_path / name).write_text(text)
    real_replace = os.replace

    def replace(src, dst):  # moving README.md aside fails
        if Path(src).name == "README.md":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        _replace_pair(
            tmp_path / "README.md", tmp_path / "card.tmp", tmp_path / "loopvq.json", meta_tmp=tmp_path / "meta.tmp"
        )
    monkeypatch.undo()
    assert (tmp_path / "README.md").read_text() == "old card" and (tmp_path / "loopvq.json").read_text() == "old meta"
    assert not (tmp_path / "card.tmp").exists() and not (tmp_path / "meta.tmp").exists()


@pytest.mark.parametrize("durable", [False, True])
def test_write_bytes_atomic_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch, durable):
    target = tmp_path / "f.json"
    write_json_atomic(target, {"a": [1, 2]})
    assert json.loads(target.read_bytes()) == {"a": [1, 2]}
    write_bytes_atomic(target, b"new", durable)
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    write_bytes_atomic(target, b"again", durable)
    assert len(synced) == durable

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="Input/output error"):
        write_bytes_atomic(target, b"lost", durable)
    monkeypatch.undo()
    assert target.read_bytes() == b"again" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
