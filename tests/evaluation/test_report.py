"""report.md / report.json / plots of loopvq-eval, including the served part and reports written before the rename."""

from __future__ import annotations

import copy

from loopvq_calib.bundle.eval_report import read_eval_report
from loopvq_calib.evaluation.report import (
    _accuracy_vs_bytes,
    _pyplot,
    accuracy_points,
    eval_kl,
    markdown_report,
    selection_kl,
    write_report,
)


def row(name: str, kl: float, **extra) -> dict:
    base = {
        "name": name,
        "method": "loopvq",
        "bits": {"key": 0.5, "value": 0.5},
        "sink_tokens": 8,
        "eval_kl": kl,
        "ppl_fp": 10.0,
        "ppl_quantized": 10.2,
        "ppl_increase": 0.02,
        "per_step_kl": [kl / 2] * 2,
        "nmse": {"key": 0.1, "value": 0.2},
        "nmse_per_step": {"key": [0.1, 0.1], "value": [0.2, 0.2]},
        "bundle": f"runs/{name}",
        "codebook_size": 256,
        "group_size": 16,
        "steps_per_block": 2,
        "codebook_bytes": 1000,
        "selection_kl": 0.03,
    }
    base.update(extra)
    return base


def served() -> dict:
    def bytes_(per: float, enc: int | None) -> dict:
        """An entry's bytes at 512 tokens: per token, encoded per token, against bf16's 24576."""
        return {"tokens": 512, "bytes_per_token": per, "encoded_bytes_per_token": enc, "ratio_to_bf16": per / 24576}

    return {
        "model": {"model_type": "huginn_raven", "loop_steps": 2, "recurrences": 2, "initial_state": "zero"},
        "reference": "bfloat16",
        "entries": [
            {"name": "bfloat16", "kind": "full-precision", "bits": None, "serving": None, "bytes": bytes_(24576, None)},
            {
                "name": "b1",
                "kind": "bundle",
                "bits": {"key": 0.5, "value": 0.5},
                "serving": {"sink_tokens": 8, "recent_window": 64, "page_size": 8},
                "bytes": bytes_(4014.5, 768),
            },
            {
                "name": "kivi2",
                "kind": "baseline",
                "bits": {"key": 3, "value": 3},
                "serving": {"sink_tokens": 8, "recent_window": 64, "page_size": 32},
                "bytes": bytes_(7000.0, 4608),
            },
        ],
        "tasks": {
            "tasks": ["t"],
            "limit": 10.0,
            "samples": {"t": 10},
            "scores": {
                "bfloat16": {"t": {"exact_match,first_word": 0.7}},
                "b1": {"t": {"exact_match,first_word": 0.6}},
                "kivi2": {"t": {"exact_match,first_word": 0.7}},
            },
        },
        "accuracy_drop": {"b1": {"t": 0.1}, "kivi2": {"t": 0.0}},
        "passkey": {
            "lengths": [128, 512],
            "trials_per_length": 5,
            "accuracy": {
                "bfloat16": {"128": 1.0, "512": 0.8},
                "b1": {"128": 1.0, "512": 0.4},
                "kivi2": {"128": 1.0, "512": 0.6},
            },
        },
    }


def report(**extra) -> dict:
    return {
        "model": "m",
        "dtype": "bfloat16",
        "device": "cpu",
        "loop_steps": 2,
        "data": {"dataset": "d.jsonl", "num_sequences": 2, "sequence_length": 64},
        "bundles": [row("b1", 0.02), row("kivi2", 0.05, baseline=True, bundle=None, selection_kl=None)],
        **extra,
    }


def test_served_tables_side_by_side():
    md = markdown_report(report(served=served()))
    assert "| b1 | bundle | 0.5 / 0.5 | 8 / 64 / 8 | 4014.5 | 768.0 | 0.1634 | 0.02000 |" in md
    assert "| kivi2 | baseline | 3 / 3 | 8 / 64 / 32 | 7000.0 | 4608.0 | 0.2848 | 0.05000 |" in md
    assert "| t | exact_match,first_word | 0.7000 | 0.6000 (-0.1000) | 0.7000 |" in md
    assert "| b1 | 1.00 | 0.40 |" in md and "Huginn recurrences 2, initial state zero" in md
    assert "(--limit 10)" in md
    bundles_table = md.split("## Bundles")[1].split("##")[0]
    assert "| b1 |" in bundles_table and "kivi2" not in bundles_table  # baselines have no codebooks


def test_old_report_keys_are_read():
    old = row("b1", 0.0)
    del old["eval_kl"], old["selection_kl"]
    old.update(heldout_kl=0.042, calibration_heldout_kl=0.031)
    assert eval_kl(old) == 0.042 and selection_kl(old) == 0.031
    md = markdown_report(report(bundles=[old]))
    assert "| b1 | loopvq | 0.500 / 0.500 | 8 | 0.04200 |" in md and "0.03100" in md


def test_write_report_adds_the_served_plot(tmp_path):
    paths = write_report(report(served=served()), tmp_path)
    assert {p.name for p in paths} == {
        "report.json",
        "report.md",
        "kl_by_method.png",
        "kl_per_step.png",
        "nmse_per_step.png",
        "served_accuracy.png",
        "accuracy_vs_bytes.png",
    }
    for name in ("served_accuracy.png", "accuracy_vs_bytes.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "`accuracy_vs_bytes.png`" in (tmp_path / "report.md").read_text()
    plain = write_report(report(), tmp_path / "plain")
    assert not {"served_accuracy.png", "accuracy_vs_bytes.png"} & {p.name for p in plain}
    passkey_only = served()
    del passkey_only["tasks"], passkey_only["accuracy_drop"]
    names = {p.name for p in write_report(report(served=passkey_only), tmp_path / "passkey")}
    assert "served_accuracy.png" in names and "accuracy_vs_bytes.png" not in names


def test_the_front_plots_mean_task_accuracy_against_encoded_bytes_per_entry():
    two_tasks = copy.deepcopy(served())
    scores = two_tasks["tasks"]["scores"]
    for name, value in (("bfloat16", 0.5), ("b1", 0.2), ("kivi2", 0.3)):  # a second task, its metric first
        scores[name]["u"] = {"acc": value, "acc_norm": 0.0}
    del scores["kivi2"]["t"]  # an entry scored on one task only: its mean is over that task
    expected = [(24576, (0.7 + 0.5) / 2, "bfloat16"), (768, (0.6 + 0.2) / 2, "b1"), (4608, 0.3, "kivi2")]
    points = accuracy_points(two_tasks)
    assert [(x, round(y, 12), n) for x, y, n in points] == [(x, round(y, 12), n) for x, y, n in expected]
    plt = _pyplot()
    fig = _accuracy_vs_bytes(plt, points)
    ax = fig.axes[0]
    assert ax.collections[0].get_offsets().tolist() == [[x, y] for x, y, _ in points]
    assert [t.get_text() for t in ax.texts] == ["bfloat16", "b1", "kivi2"] and ax.get_xscale() == "log"
    plt.close(fig)


def test_report_json_is_strict_json_that_loopvq_push_reads(tmp_path):
    """A non-finite number (here a baseline's perplexity) is written as a string, as bundles do, so the strict
    reader of loopvq-push takes the report; the bundle's own row reads back unchanged."""
    broken = report()
    broken["bundles"][1]["ppl_quantized"] = float("inf")
    write_report(broken, tmp_path)
    text = (tmp_path / "report.json").read_text()
    assert "Infinity" not in text and '"ppl_quantized": "inf"' in text
    read = read_eval_report(tmp_path)
    assert read["bundles"][0] == broken["bundles"][0] and read["bundles"][1]["ppl_quantized"] == "inf"
