"""The model card: front matter through ModelCardData, evaluation results as model-index, loopvq-push --eval-report."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, tiny_quantizer, write_tiny_bundle
from huggingface_hub import ModelCard

from loopvq_calib.bundle.card import (
    EvalReportError,
    _replace_pair,
    attach_eval_report,
    evaluation_for,
    is_hub_id,
    model_card,
)
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.cli import push_main
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.models.loading import model_identity
from loopvq_calib.runtime.files import TMP_PREFIX, write_bytes_atomic, write_json_atomic

GOLDEN = ROOT / "tests" / "golden" / "ouro_loopvq"


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return Path(shutil.copytree(GOLDEN, tmp_path / "bundle"))


def eval_report(name: str) -> dict:
    """A loopvq-eval report.json as run_eval writes it (one bundle, one baseline, tasks and passkey)."""
    task = {"exact_match,first_word": 0.5}
    return {
        "model": "org/tiny-ouro", "dtype": "bfloat16", "device": "cpu", "data": {"dataset": "heldout.jsonl"},
        "loop_steps": 4,
        "bundles": [{"name": name, "eval_kl": 0.0123, "ppl_fp": 10.0, "ppl_quantized": 10.5},
                    {"name": "kivi2", "baseline": True, "eval_kl": 0.05, "ppl_fp": 10.0, "ppl_quantized": 11.0}],
        "served": {
            "reference": "bfloat16",
            "entries": [{"name": "bfloat16", "serving": None},
                        {"name": name, "serving": {"sink_tokens": 8, "recent_window": 64, "page_size": 8}}],
            "tasks": {"scores": {"bfloat16": {"loopvq_kjv_phrases": {"exact_match,first_word": 0.75}},
                                 name: {"loopvq_kjv_phrases": task}, "kivi2": {"loopvq_kjv_phrases": task}}},
            "passkey": {"lengths": [256], "accuracy": {"bfloat16": {"256": 1.0}, name: {"256": 0.8}}},
        },
    }


def test_card_without_evaluation_has_no_model_index(bundle_dir):
    meta = load_bundle(bundle_dir).meta
    card = ModelCard(model_card(meta))
    assert card.data.base_model == meta["model"]["name"] and card.data.library_name == "loopvq-calib"
    assert card.data.eval_results is None and "## Evaluation" not in card.content


def test_evaluation_results_become_model_index(bundle_dir):
    meta = load_bundle(bundle_dir).meta
    card = ModelCard(model_card(meta, evaluation_for(eval_report(meta["name"]), meta["name"])))
    results = {(r.dataset_name, r.metric_type): r for r in card.data.eval_results}
    assert card.data.model_name == meta["name"]
    assert results[("heldout.jsonl", "kl")].metric_value == 0.0123
    assert results[("heldout.jsonl", "perplexity")].metric_value == 10.5
    task = results[("loopvq_kjv_phrases", "exact_match")]
    assert task.metric_value == 0.5 and "sinks 8, recent window 64" in task.metric_name
    assert results[("passkey 256 tokens", "accuracy")].metric_value == 0.8
    assert "| exact_match,first_word | loopvq_kjv_phrases | 0.5 | 0.75 |" in card.content
    with pytest.raises(EvalReportError, match="no bundle named 'other' .*has: " + meta["name"]):
        evaluation_for(eval_report(meta["name"]), "other")  # a baseline row is never a bundle


def test_push_with_eval_report_rewrites_the_card_and_its_checksum(bundle_dir, tmp_path, capsys):
    name = load_bundle(bundle_dir).meta["name"]
    report = tmp_path / "eval"
    report.mkdir()
    (report / "report.json").write_text(json.dumps(eval_report(name)))
    before = (bundle_dir / "README.md").read_bytes()
    argv = [str(bundle_dir), "--repo-id", "org/name", "--dry-run", "--eval-report", str(report)]
    assert push_main(argv) == 0
    assert "would add 4 evaluation results" in capsys.readouterr().out
    assert (bundle_dir / "README.md").read_bytes() == before  # a dry run changes nothing
    results = attach_eval_report(bundle_dir, report / "report.json")
    assert len(results) == 4  # KL, perplexity, one task metric, one passkey length
    bundle = load_bundle(bundle_dir)  # checksums still hold
    assert "## Evaluation" in (bundle_dir / "README.md").read_text()
    assert not [p for p in bundle_dir.iterdir() if p.name.startswith(".loopvq-tmp.")]  # the old card is gone too
    assert bundle.meta["files"]["README.md"]["bytes"] == (bundle_dir / "README.md").stat().st_size
    (tmp_path / "bad.json").write_text("{not json")
    assert push_main([str(bundle_dir), "--repo-id", "org/name", "--dry-run", "--eval-report",
                      str(tmp_path / "bad.json")]) == 2
    assert "cannot read an evaluation report" in capsys.readouterr().err


def _bundle_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("failing_write", [1, 2])  # 1: the new README.md, 2: the new loopvq.json
def test_attach_eval_report_failing_mid_write_leaves_the_old_bundle(bundle_dir, tmp_path, monkeypatch, failing_write):
    name = load_bundle(bundle_dir).meta["name"]
    (tmp_path / "report.json").write_text(json.dumps(eval_report(name)))
    before = _bundle_files(bundle_dir)
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
    assert _bundle_files(bundle_dir) == before  # same files, same bytes, no temporary left behind
    load_bundle(bundle_dir)


@pytest.mark.parametrize("failing", ["loopvq.json", "README.md"])  # the new manifest's rename, the new card's
def test_attach_eval_report_failing_rename_of_the_manifest_restores_the_card(bundle_dir, tmp_path, monkeypatch,
                                                                            failing):
    """The old card is moved aside and renamed back (the same file, not a rewritten copy); nothing is left over."""
    name = load_bundle(bundle_dir).meta["name"]
    (tmp_path / "report.json").write_text(json.dumps(eval_report(name)))
    before, card_inode = _bundle_files(bundle_dir), (bundle_dir / "README.md").stat().st_ino
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
    assert _bundle_files(bundle_dir) == before and (bundle_dir / "README.md").stat().st_ino == card_inode
    load_bundle(bundle_dir)


def test_failing_first_rename_never_restores_a_stale_aside_card(tmp_path, monkeypatch):
    """When moving the old card aside fails, a file a killed attempt left at the aside name stays where it is:
    README.md keeps the old card, not the stale one."""
    for name, text in (("README.md", "old card"), ("loopvq.json", "old meta"), ("card.tmp", "new card"),
                       ("meta.tmp", "new meta"), (f"{TMP_PREFIX}README.md.old.{os.getpid()}", "stale card")):
        (tmp_path / name).write_text(text)
    real_replace = os.replace

    def replace(src, dst):  # moving README.md aside fails
        if Path(src).name == "README.md":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        _replace_pair(tmp_path / "README.md", tmp_path / "card.tmp", tmp_path / "loopvq.json", meta_tmp=tmp_path / "meta.tmp")
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


def test_card_base_model_is_only_ever_a_hub_id(tmp_path, tiny_ouro_dir):
    def front(path):
        return yaml.safe_load((path / "README.md").read_text().split("---")[1])

    assert front(write_tiny_bundle(tmp_path / "hub", tiny_ouro_dir))["base_model"] == "org/tiny-ouro"
    local = write_bundle(tmp_path / "local", tiny_quantizer(tiny_ouro_dir), name="x",
                         identity=model_identity(tiny_ouro_dir, str(tiny_ouro_dir.absolute())),
                         calibration={}, metrics={}, serving=ServingConfig(8, 64, 8), codebook_dtype="float16",
                         config={}, producer_version="0")
    assert "base_model" not in front(local)
    assert [is_hub_id(n) for n in ("org/name", "/abs/path", "./rel/x", "a/b/c", "name", "../m")] == [
        True, False, False, False, False, False]
