"""loopvq-eval --out under --output's rules: its report files replace only what it wrote there (its record), never
through a link; a user's file beside them is never touched."""

from __future__ import annotations

import hashlib
import json

import pytest

from loopvq_calib.evaluation.out_folder import OUT_RECORD, OutFolderError, check_out_folder, write_out_files


def test_a_rerun_replaces_its_own_files_and_leaves_the_users(tmp_path):
    out = tmp_path / "eval"
    write_out_files(out, {"report.json": b"{}", "report.md": b"# one"})
    (out / "notes.txt").write_text("mine")
    record = json.loads((out / OUT_RECORD).read_text())
    assert record == {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("report.json", "report.md")
    }
    check_out_folder(out)
    write_out_files(out, {"report.md": b"# two"})
    assert (out / "report.md").read_bytes() == b"# two" and (out / "notes.txt").read_text() == "mine"


def test_an_edited_a_foreign_or_a_linked_report_file_is_refused_and_left_as_it_is(tmp_path):
    out = tmp_path / "eval"
    write_out_files(out, {"report.md": b"# one"})
    (out / "report.md").write_text("edited by hand")
    with pytest.raises(OutFolderError, match="report.md was not written by loopvq-eval, or was edited since"):
        write_out_files(out, {"report.md": b"# two"})
    assert (out / "report.md").read_text() == "edited by hand"
    (out / "report.md").unlink()
    outside = tmp_path / "outside.md"
    outside.write_text("precious")
    (out / "report.md").symlink_to(outside)
    with pytest.raises(OutFolderError, match="report.md is a symbolic link; loopvq-eval never writes through a link"):
        check_out_folder(out)
    assert outside.read_text() == "precious"
    (out / "report.md").unlink()
    (out / "report.json").write_text("{}")  # a user's file of that name, never recorded
    with pytest.raises(OutFolderError, match="report.json was not written by loopvq-eval"):
        check_out_folder(out)


def test_out_must_be_a_folder_and_only_report_files_are_written(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutFolderError, match="exists and is not a folder"):
        check_out_folder(tmp_path / "f")
    with pytest.raises(ValueError, match="not a report file of loopvq-eval: notes.txt"):
        write_out_files(tmp_path / "eval", {"notes.txt": b"x"})
    check_out_folder(None)
