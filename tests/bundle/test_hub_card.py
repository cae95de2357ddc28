"""loopvq-push with an evaluation report: the new card is written into the folder only after the hub took it (a
dry run, an offline push and a failed commit write nothing; a failed local write after the push is a push error
that keeps the old pair), or instead of a push (--write-card-only). Against a fake hub at huggingface_hub's HTTP
layer (support/fake_hub.py), never the network."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from support.eval_reports import eval_report, write_report
from support.fake_hub import (
    failing_commit,
    fake_hub,  # noqa: F401 (the fixture)
)
from support.golden import (
    bundle_dir,  # noqa: F401 (the fixture)
    bundle_files,
)

from loopvq_calib.bundle.card import EvalReportError, prepare_eval_report
from loopvq_calib.bundle.hub import PushError, push_bundle
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.cli import push_main

# -- an evaluation report pushed with the bundle ----------------------------------------------------------


def test_the_new_card_is_written_only_after_the_hub_took_it(bundle_dir, fake_hub, tmp_path, monkeypatch):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    attachment = prepare_eval_report(bundle_dir, report)
    before = bundle_files(bundle_dir)
    listed = ["README.md", "codebooks.safetensors", "loopvq.json"]
    assert push_bundle(bundle_dir, "org/x", dry_run=True, attachment=attachment) == listed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PushError, match="offline mode is on"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake_hub.fail = failing_commit(503)
    with pytest.raises(PushError, match="HTTP 503"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    assert bundle_files(bundle_dir) == before  # a dry run, an offline push and a failed commit write nothing
    fake_hub.fail = None
    assert push_bundle(bundle_dir, "org/x", attachment=attachment) == listed
    sent = fake_hub.commits[-1]["files"]
    assert sent["README.md"] == attachment.card and sent["loopvq.json"] == attachment.meta
    assert sent["codebooks.safetensors"] == before["codebooks.safetensors"]
    assert bundle_files(bundle_dir) == sent  # the folder now holds what the hub holds
    assert "## Evaluation" in load_bundle(bundle_dir).path.joinpath("README.md").read_text()
    requests = len(fake_hub.requests)
    with pytest.raises(EvalReportError, match=r"loopvq\.json: changed since the evaluation report was prepared"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)  # prepared against the old loopvq.json
    assert len(fake_hub.requests) == requests


def fail_meta_rename(monkeypatch) -> None:
    """Make the rename of a new loopvq.json into place fail (EIO); every other rename works."""
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "loopvq.json":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_failed_local_write_after_the_push_is_a_push_error_and_keeps_the_old_pair(
    bundle_dir, fake_hub, tmp_path, monkeypatch
):
    attachment = prepare_eval_report(
        bundle_dir, write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    )
    before = bundle_files(bundle_dir)
    fail_meta_rename(monkeypatch)
    with pytest.raises(
        PushError,
        match=r"pushed .* to org/x, but writing the new README\.md and loopvq\.json into "
        r"the folder failed \(\[Errno 5\] Input/output error\)",
    ):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    monkeypatch.undo()
    assert len(fake_hub.commits) == 1 and bundle_files(bundle_dir) == before


def test_loopvq_push_writes_the_card_only_after_the_push(bundle_dir, fake_hub, tmp_path, monkeypatch, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    before = bundle_files(bundle_dir)
    argv = [str(bundle_dir), "--repo-id", "org/x", "--eval-report", str(report)]
    assert push_main(argv + ["--dry-run"]) == 0 and "would add 4 evaluation results" in capsys.readouterr().out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert push_main(argv) == 3 and "offline mode is on" in capsys.readouterr().err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake_hub.fail = failing_commit(500)
    assert push_main(argv) == 3 and "HTTP 500" in capsys.readouterr().err
    assert bundle_files(bundle_dir) == before and fake_hub.commits == []  # nothing written by a failed push
    fake_hub.fail = None
    assert push_main(argv) == 0 and "added 4 evaluation results" in capsys.readouterr().out
    assert bundle_files(bundle_dir) == fake_hub.commits[-1]["files"] != before
    other = write_report(eval_report({**load_bundle(bundle_dir).meta, "method": "cq"}), tmp_path / "other.json")
    assert push_main([str(bundle_dir), "--repo-id", "org/x", "--eval-report", str(other)]) == 2
    assert "measured another bundle" in capsys.readouterr().err and len(fake_hub.commits) == 1


def test_write_card_only_writes_what_a_push_would_and_sends_nothing(bundle_dir, fake_hub, tmp_path, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    attachment = prepare_eval_report(bundle_dir, report)
    before = bundle_files(bundle_dir)
    argv = [str(bundle_dir), "--eval-report", str(report), "--write-card-only"]
    assert push_main(argv + ["--dry-run"]) == 0 and bundle_files(bundle_dir) == before
    card = bundle_dir / "README.md"
    assert capsys.readouterr().out == f"would write 4 evaluation results into {card} (nothing pushed)\n"
    assert push_main(argv) == 0
    assert capsys.readouterr().out == (
        f"wrote 4 evaluation results into {card} and its checksum into loopvq.json (nothing pushed)\n"
    )
    assert bundle_files(bundle_dir) == {**before, "README.md": attachment.card, "loopvq.json": attachment.meta}
    assert "## Evaluation" in (bundle_dir / "README.md").read_text() and load_bundle(bundle_dir)
    assert fake_hub.requests == []
    assert push_main([str(bundle_dir), "--write-card-only"]) == 2
    assert "--write-card-only writes the card of an evaluation report" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a push still needs its repo
        push_main([str(bundle_dir), "--dry-run"])
    assert stop.value.code == 2 and "the following arguments are required: --repo-id" in capsys.readouterr().err


def test_write_card_only_failing_keeps_the_old_pair_and_exits_3(bundle_dir, tmp_path, monkeypatch, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    before = bundle_files(bundle_dir)
    fail_meta_rename(monkeypatch)
    assert push_main([str(bundle_dir), "--eval-report", str(report), "--write-card-only"]) == 3
    assert capsys.readouterr().err == (
        f"error: writing the new README.md and loopvq.json into {bundle_dir} failed "
        "(Input/output error); the folder keeps its old pair\n"
    )
    monkeypatch.undo()
    assert bundle_files(bundle_dir) == before
