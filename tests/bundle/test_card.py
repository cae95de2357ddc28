"""The model card: front matter through ModelCardData, evaluation results as model-index, loopvq-push --eval-report."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, tiny_quantizer, write_tiny_bundle
from huggingface_hub import ModelCard
from support.eval_reports import eval_report, write_report

from loopvq_calib.bundle.card import (
    EvalReportError,
    _replace_pair,
    attach_eval_report,
    evaluation_for,
    is_hub_id,
    model_card,
    prepare_eval_report,
)
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.cli import push_main
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.evaluation.evaluate import evaluate
from loopvq_calib.models.loading import model_identity
from loopvq_calib.runtime.files import TMP_PREFIX, write_bytes_atomic, write_json_atomic

GOLDEN = ROOT / "tests" / "golden" / "ouro_loopvq"


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return Path(shutil.copytree(GOLDEN, tmp_path / "bundle"))


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


def _bundle_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("failing_write", [1, 2])  # 1: the new README.md, 2: the new loopvq.json
def test_attach_eval_report_failing_mid_write_leaves_the_old_bundle(bundle_dir, tmp_path, monkeypatch, failing_write):
    (tmp_path / "report.json").write_text(json.dumps(eval_report(load_bundle(bundle_dir).meta)))
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
def test_attach_eval_report_failing_rename_of_the_manifest_restores_the_card(
    bundle_dir, tmp_path, monkeypatch, failing
):
    """The old card is moved aside and renamed back (the same file, not a rewritten copy); nothing is left over."""
    (tmp_path / "report.json").write_text(json.dumps(eval_report(load_bundle(bundle_dir).meta)))
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


# -- which bundle a report measured -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def measured(tmp_path_factory, tiny_ouro_dir) -> tuple[Path, Path]:
    """A tiny bundle and the report.json of loopvq-eval's measurement of it (``evaluate``; the plots, which its
    placeholder fine-tuning curve cannot draw, left out)."""
    root = tmp_path_factory.mktemp("measured")
    bundle = write_tiny_bundle(root / "bundle", tiny_ouro_dir)
    result = evaluate([bundle], model=str(tiny_ouro_dir), num_sequences=1, sequence_length=32, device="cpu")
    (root / "eval").mkdir()
    write_report(result.report, root / "eval" / "report.json")
    return bundle, root / "eval"


def _other_bundle(folder: Path, model_dir: Path, **changes) -> Path:
    """A bundle of the same name as write_tiny_bundle's, calibrated differently (``changes`` to its metrics,
    or a ``quantizer``)."""
    quantizer = changes.pop("quantizer", None) or tiny_quantizer(model_dir)
    metrics = {"heldout_kl": 0.0123, "heldout_kl_init": 0.0456, "ppl_increase": 0.021, "finetune_curve": [{}, {}]}
    return write_bundle(
        folder,
        quantizer,
        name="tiny",
        identity=model_identity(model_dir, "org/tiny-ouro", "main"),
        calibration={"dataset": "other", "seed": 1},
        metrics={**metrics, **changes},
        serving=ServingConfig(8, 64, 8),
        codebook_dtype="float16",
        config={"quant": {"method": quantizer.method}},
        producer_version="0.1.0",
    )


def test_a_real_report_attaches_to_its_bundle_and_to_no_other_of_that_name(measured, tmp_path, tiny_ouro_dir, capsys):
    bundle, report = measured
    copy = Path(shutil.copytree(bundle, tmp_path / "copy"))  # the measured bundle, elsewhere
    assert len(attach_eval_report(copy, report)) == 2  # evaluation KL and perplexity
    assert "## Evaluation" in (copy / "README.md").read_text() and load_bundle(copy)
    cases = [
        (
            _other_bundle(tmp_path / "seed", tiny_ouro_dir, heldout_kl=0.0311),
            "selection_kl is 0.0123, this bundle's is 0.0311",
        ),
        (
            _other_bundle(tmp_path / "method", tiny_ouro_dir, quantizer=tiny_quantizer(tiny_ouro_dir, "loopvq")),
            'codebooks_sha256 is "[0-9a-f]{64}", this bundle\'s is "[0-9a-f]{64}"',
        ),
    ]  # other codebooks
    for other, message in cases:
        before = _bundle_files(other)
        with pytest.raises(EvalReportError, match="the report measured another bundle named 'tiny': its " + message):
            attach_eval_report(other, report)
        assert push_main([str(other), "--repo-id", "org/x", "--dry-run", "--eval-report", str(report)]) == 2
        assert "measured another bundle named 'tiny'" in capsys.readouterr().err
        assert _bundle_files(other) == before


@pytest.mark.parametrize(
    "field,value",
    [
        ("codebook_size", 256),
        ("group_size", 16),
        ("steps_per_block", 1),
        ("method", "cq"),
        ("bits", {"key": 1.0, "value": 0.5}),
        ("sink_tokens", 0),
        ("serving", {"sink_tokens": 0, "recent_window": 64, "page_size": 8}),
        ("selection_kl", 0.5),
        ("finetune_curve", []),
        ("codebooks_sha256", "0" * 64),
    ],
)
def test_a_row_that_differs_from_the_bundle_in_any_recorded_field_is_refused(bundle_dir, tmp_path, field, value):
    report = eval_report(load_bundle(bundle_dir).meta)
    report["bundles"][0][field] = value
    before = _bundle_files(bundle_dir)
    with pytest.raises(EvalReportError, match=f"another bundle named 'ouro_loopvq': its {field} is "):
        attach_eval_report(bundle_dir, write_report(report, tmp_path / "report.json"))
    assert _bundle_files(bundle_dir) == before


def test_what_the_row_must_record_and_the_names_older_reports_use(bundle_dir, tmp_path):
    meta = load_bundle(bundle_dir).meta
    report = eval_report(meta)
    del report["bundles"][0]["serving"]
    with pytest.raises(
        EvalReportError, match="row of bundle 'ouro_loopvq' records no serving, so it cannot be matched to this bundle"
    ):
        prepare_eval_report(bundle_dir, write_report(report, tmp_path / "report.json"))
    report = eval_report(meta)
    row = report["bundles"][0]
    row["calibration_heldout_kl"] = row.pop("selection_kl")  # the KL's name before the rename
    row["codebooks_sha256"] = meta["files"]["codebooks.safetensors"]["sha256"]
    attachment = prepare_eval_report(bundle_dir, write_report(report, tmp_path / "report.json"))
    assert len(attachment.results) == 4 and attachment.replaces == (bundle_dir / "loopvq.json").read_bytes()
    assert _bundle_files(bundle_dir)["README.md"] != attachment.card  # prepared, not written


# -- a report's shape and its one row of the bundle ------------------------------------------------------------
def _report_file(bundle_dir: Path, tmp_path: Path, edit) -> Path:
    """report.json of the golden bundle's report (support/eval_reports.py), ``edit``ed."""
    report = eval_report(load_bundle(bundle_dir).meta)
    edit(report)
    return write_report(report, tmp_path / "report.json")


def test_two_rows_of_the_bundles_name_are_refused_and_a_baseline_of_that_name_is_no_row(bundle_dir, tmp_path):
    before = _bundle_files(bundle_dir)
    file = _report_file(bundle_dir, tmp_path, lambda r: r["bundles"].append({**r["bundles"][0], "eval_kl": 0.5}))
    message = f"--eval-report {file}: 2 rows (bundles[0], bundles[2]) measured a bundle named 'ouro_loopvq', so "
    with pytest.raises(EvalReportError, match=re.escape(message)):
        prepare_eval_report(bundle_dir, file)
    with pytest.raises(EvalReportError, match=r"2 rows \(bundles\[0\], bundles\[2\]\) measured a bundle named"):
        evaluation_for(json.loads(file.read_text()), "ouro_loopvq")
    assert _bundle_files(bundle_dir) == before
    baseline = {"name": "ouro_loopvq", "baseline": True, "eval_kl": 0.5, "ppl_fp": 10.0, "ppl_quantized": 99.0}
    attachment = prepare_eval_report(
        bundle_dir, _report_file(bundle_dir, tmp_path, lambda r: r["bundles"].insert(0, baseline))
    )
    values = {r.metric_type: r.metric_value for r in attachment.results}
    assert values["kl"] == 0.0123 and values["perplexity"] == 10.5  # the bundle's row (support/eval_reports.py)


@pytest.mark.parametrize(
    "edit, field, problem",
    [
        (lambda r: r["bundles"][0].pop("ppl_quantized"), "bundles[0].ppl_quantized", "is missing"),
        (lambda r: r["bundles"][0].update(eval_kl="abc"), "bundles[0].eval_kl", "is 'abc', not a finite number"),
        (lambda r: r["bundles"][0].update(ppl_fp=[1.0]), "bundles[0].ppl_fp", "is [1.0], not a finite number"),
        (lambda r: r["bundles"].insert(0, 5), "bundles[0]", "is 5, not an object"),
        (lambda r: r["bundles"][1].pop("name"), "bundles[1].name", "is missing"),
        (lambda r: r.update(model=["org/x"]), "model", "is ['org/x'], not a string or null"),
        (
            lambda r: r["served"]["entries"][1].update(serving=5),
            "served.entries[1].serving",
            "is 5, not an object or null",
        ),
        (
            lambda r: r["served"]["entries"][1]["serving"].update(recent_window="64"),
            "served.entries[1].serving.recent_window",
            "is '64', not a non-negative integer",
        ),
        (
            lambda r: r["served"]["entries"].append(r["served"]["entries"][1]),
            "served.entries[2].name",
            "repeats the entry 'ouro_loopvq'",
        ),
        (
            lambda r: r["served"]["tasks"]["scores"]["ouro_loopvq"]["loopvq_recall"].update(
                {"exact_match,answer": "0.5"}
            ),
            "served.tasks.scores.ouro_loopvq.loopvq_recall.exact_match,answer",
            "is '0.5', not a finite number",
        ),
        (
            lambda r: r["served"]["passkey"].update(accuracy=[0.8]),
            "served.passkey.accuracy",
            "is [0.8], not an object or null",
        ),
    ],
)
def test_a_malformed_report_names_the_file_and_the_field(bundle_dir, tmp_path, edit, field, problem):
    file = _report_file(bundle_dir, tmp_path, edit)
    with pytest.raises(EvalReportError, match=re.escape(f"--eval-report {file}: field {field} {problem}; ")):
        prepare_eval_report(bundle_dir, file)
    with pytest.raises(EvalReportError, match=re.escape(f"the evaluation report: field {field} {problem}; ")):
        evaluation_for(json.loads(file.read_text()), "ouro_loopvq")


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply to read"),
        ('{"bundles": [], "bundles": []}', "field bundles appears more than once (duplicate JSON key)"),
        ('{"bundles": [{"name": "x", "eval_kl": NaN}]}', "field bundles[0].eval_kl is a bare NaN"),
        ("{not json", "not valid JSON"),
    ],
)
def test_a_report_that_is_not_strict_json_names_the_file(bundle_dir, tmp_path, text, problem):
    file = tmp_path / "report.json"
    file.write_text(text)
    with pytest.raises(
        EvalReportError, match=re.escape(f"--eval-report: cannot read an evaluation report: {file}: {problem}")
    ):
        prepare_eval_report(bundle_dir, file)


def test_a_row_without_the_codebooks_sha256_is_refused(bundle_dir, tmp_path):
    file = _report_file(bundle_dir, tmp_path, lambda r: r["bundles"][0].pop("codebooks_sha256"))
    with pytest.raises(
        EvalReportError,
        match=re.escape(
            f"--eval-report {file}: the row of bundle 'ouro_loopvq' records no codebooks_sha256, so it cannot be "
            "matched to this bundle; run loopvq-eval on it again"
        ),
    ):
        prepare_eval_report(bundle_dir, file)
