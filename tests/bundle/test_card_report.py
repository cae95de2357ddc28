"""The evaluation report a card is written from: which bundle it measured (a real loopvq-eval report attaches
to its bundle and to no other of that name, a row differing in any recorded field is refused, what a row must
record), and its shape (two rows of the bundle's name, malformed fields, JSON that is not strict, a row without
codebooks_sha256), each refused naming the file and the field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import tiny_quantizer, write_tiny_bundle
from support.eval_reports import eval_report, write_report
from support.golden import (
    bundle_dir,  # noqa: F401 (the fixture)
    bundle_files,
)

from loopvq_calib.bundle.card import EvalReportError, attach_eval_report, evaluation_for, prepare_eval_report
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.cli import push_main
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.evaluation.evaluate import evaluate
from loopvq_calib.models.loading import model_identity


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
        before = bundle_files(other)
        with pytest.raises(EvalReportError, match="the report measured another bundle named 'tiny': its " + message):
            attach_eval_report(other, report)
        assert push_main([str(other), "--repo-id", "org/x", "--dry-run", "--eval-report", str(report)]) == 2
        assert "measured another bundle named 'tiny'" in capsys.readouterr().err
        assert bundle_files(other) == before


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
    before = bundle_files(bundle_dir)
    with pytest.raises(EvalReportError, match=f"another bundle named 'ouro_loopvq': its {field} is "):
        attach_eval_report(bundle_dir, write_report(report, tmp_path / "report.json"))
    assert bundle_files(bundle_dir) == before


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
    assert bundle_files(bundle_dir)["README.md"] != attachment.card  # prepared, not written


# -- a report's shape and its one row of the bundle ------------------------------------------------------------
def _report_file(bundle_dir: Path, tmp_path: Path, edit) -> Path:
    """report.json of the golden bundle's report (support/eval_reports.py), ``edit``ed."""
    report = eval_report(load_bundle(bundle_dir).meta)
    edit(report)
    return write_report(report, tmp_path / "report.json")


def test_two_rows_of_the_bundles_name_are_refused_and_a_baseline_of_that_name_is_no_row(bundle_dir, tmp_path):
    before = bundle_files(bundle_dir)
    file = _report_file(bundle_dir, tmp_path, lambda r: r["bundles"].append({**r["bundles"][0], "eval_kl": 0.5}))
    message = f"--eval-report {file}: 2 rows (bundles[0], bundles[2]) measured a bundle named 'ouro_loopvq', so "
    with pytest.raises(EvalReportError, match=re.escape(message)):
        prepare_eval_report(bundle_dir, file)
    with pytest.raises(EvalReportError, match=r"2 rows \(bundles\[0\], bundles\[2\]\) measured a bundle named"):
        evaluation_for(json.loads(file.read_text()), "ouro_loopvq")
    assert bundle_files(bundle_dir) == before
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
