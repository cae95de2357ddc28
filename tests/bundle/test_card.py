"""The model card: front matter through ModelCardData, evaluation results as model-index, loopvq-push --eval-report,
base_model only a hub id. Its writes: test_card_writes.py; the report it is written from: test_card_report.py."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_quantizer, write_tiny_bundle
from huggingface_hub import ModelCard
from support.eval_reports import eval_report
from support.golden import bundle_dir  # noqa: F401 (the fixture)

from loopvq_calib.bundle.card import EvalReportError, attach_eval_report, evaluation_for, is_hub_id, model_card
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.cli import push_main
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.models.loading import model_identity


def test_card_without_evaluation_has_no_model_index(bundle_dir):
    meta = load_bundle(bundle_dir).meta
    card = ModelCard(model_card(meta))
    assert card.data.base_model == meta["model"]["name"] and card.data.library_name == "loopvq-calib"
    assert card.data.eval_results is None and "## Evaluation" not in card.content


def test_evaluation_results_become_model_index(bundle_dir):
    meta = load_bundle(bundle_dir).meta
    card = ModelCard(model_card(meta, evaluation_for(eval_report(meta), meta["name"])))
    results = {(r.dataset_name, r.metric_type): r for r in card.data.eval_results}
    assert card.data.model_name == meta["name"]
    assert results[("heldout.jsonl", "kl")].metric_value == 0.0123
    assert results[("heldout.jsonl", "perplexity")].metric_value == 10.5
    task = results[("loopvq_recall", "exact_match")]
    assert task.metric_value == 0.5 and "sinks 8, recent window 64" in task.metric_name
    assert results[("passkey 256 tokens", "accuracy")].metric_value == 0.8
    assert "| exact_match,answer | `loopvq_recall` | 0.5 | 0.75 |" in card.content
    with pytest.raises(EvalReportError, match="no bundle named 'other' .*has: " + meta["name"]):
        evaluation_for(eval_report(meta), "other")  # a baseline row is never a bundle


def test_push_with_eval_report_rewrites_the_card_and_its_checksum(bundle_dir, tmp_path, capsys):
    report = tmp_path / "eval"
    report.mkdir()
    (report / "report.json").write_text(json.dumps(eval_report(load_bundle(bundle_dir).meta)))
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
    assert (
        push_main([str(bundle_dir), "--repo-id", "org/name", "--dry-run", "--eval-report", str(tmp_path / "bad.json")])
        == 2
    )
    assert "cannot read an evaluation report" in capsys.readouterr().err


def test_card_base_model_is_only_ever_a_hub_id(tmp_path, tiny_ouro_dir):
    def front(path):
        return yaml.safe_load((path / "README.md").read_text().split("---")[1])

    assert front(write_tiny_bundle(tmp_path / "hub", tiny_ouro_dir))["base_model"] == "org/tiny-ouro"
    local = write_bundle(
        tmp_path / "local",
        tiny_quantizer(tiny_ouro_dir),
        name="x",
        identity=model_identity(tiny_ouro_dir, str(tiny_ouro_dir.absolute())),
        calibration={},
        metrics={},
        serving=ServingConfig(8, 64, 8),
        codebook_dtype="float16",
        config={},
        producer_version="0",
    )
    assert "base_model" not in front(local)
    assert [is_hub_id(n) for n in ("org/name", "/abs/path", "./rel/x", "a/b/c", "name", "../m")] == [
        True,
        False,
        False,
        False,
        False,
        False,
    ]
