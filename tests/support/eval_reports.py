"""loopvq-eval report.json contents for tests of attaching a report to a bundle (``loopvq-push --eval-report``):
a bundle's row as evaluation/evaluate.py writes it and a whole report with tasks and passkey."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def measured_row(meta: dict[str, Any], **measured: Any) -> dict[str, Any]:
    """A bundle's row of a report: what evaluate.py copies from the bundle's ``loopvq.json`` (codebooks sha256,
    settings, serving defaults, calibration metrics) and the measured numbers (``measured`` overrides the defaults)."""
    metrics = meta["metrics"]
    return {
        "name": meta["name"],
        "codebooks_sha256": meta["files"]["codebooks.safetensors"]["sha256"],
        "method": meta["method"],
        "bits": meta["bits"],
        "codebook_size": meta["codebook_size"],
        "group_size": meta["group_size"],
        "steps_per_block": meta["steps_per_block"],
        "sink_tokens": meta["serving"]["sink_tokens"],
        "serving": meta["serving"],
        "bundle": "runs/x/bundle",
        "selection_kl": metrics.get("selection_kl", metrics.get("heldout_kl")),
        "finetune_curve": metrics.get("finetune_curve"),
        **({"eval_kl": 0.0123, "ppl_fp": 10.0, "ppl_quantized": 10.5} | measured),
    }


def eval_report(meta: dict[str, Any]) -> dict[str, Any]:
    """A report of the bundle ``meta`` describes: its row, one baseline, served tasks and passkey."""
    name = meta["name"]
    task = {"exact_match,answer": 0.5}
    return {
        "model": "org/tiny-ouro",
        "dtype": "bfloat16",
        "device": "cpu",
        "data": {"dataset": "heldout.jsonl"},
        "loop_steps": 4,
        "bundles": [
            measured_row(meta),
            {"name": "kivi2", "baseline": True, "eval_kl": 0.05, "ppl_fp": 10.0, "ppl_quantized": 11.0},
        ],
        "served": {
            "reference": "bfloat16",
            "entries": [
                {"name": "bfloat16", "serving": None},
                {"name": name, "serving": {"sink_tokens": 8, "recent_window": 64, "page_size": 8}},
            ],
            "tasks": {
                "scores": {
                    "bfloat16": {"loopvq_recall": {"exact_match,answer": 0.75}},
                    name: {"loopvq_recall": task},
                    "kivi2": {"loopvq_recall": task},
                }
            },
            "passkey": {"lengths": [256], "accuracy": {"bfloat16": {"256": 1.0}, name: {"256": 0.8}}},
        },
    }


def write_report(report: dict[str, Any], file: Path) -> Path:
    """``report`` as report.json at ``file`` (as evaluation/report.py writes it: NaN allowed)."""
    file.write_text(json.dumps(report, indent=1, allow_nan=True) + "\n", encoding="utf-8")
    return file
