"""benchmarks/reproduction/quality_served.py: the served-cache table of docs/quality.md joins the two stored
loopvq-eval reports per entry, and its ranking sentence follows the stored numbers."""

from __future__ import annotations

import copy
import json

from benchmarks.reproduction import quality_served as qs, reproduce_report as rr


def _served() -> dict:
    def entry(name, bits, per_token, encoded, window):
        return {
            "name": name,
            "bits": bits,
            "serving": None if window is None else {"recent_window": window},
            "bytes": {"bytes_per_token": per_token, "encoded_bytes_per_token": encoded},
        }

    def report(window, per_token, scores, passkey=None):
        served = {
            "entries": [
                entry("bfloat16", None, 24576.0, None, None),
                entry("b-loopvq", {"key": 0.5, "value": 0.5}, per_token, 768.0, window),
            ],
            "tasks": {
                "tasks": ["t"],
                "limit": 12.0,
                "scores": {"bfloat16": {"t": {"acc": 0.75}}, "b-loopvq": {"t": {"acc": scores}}},
            },
        }
        if passkey:
            served["passkey"] = passkey
        return {
            "bundles": [{"name": "b-loopvq", "eval_kl": 0.1066, "ppl_increase": 0.0743}],
            "data": {"num_sequences": 2, "sequence_length": 512},
            "served": served,
        }

    keys = {
        "lengths": [256, 1024],
        "accuracy": {"bfloat16": {"256": 1.0, "1024": 0.0}, "b-loopvq": {"256": 0.0, "1024": 1.0}},
    }
    return {"report": report(64, 4116.0, 0.5, keys), "window0": report(0, 1140.0, 0.25)}


def test_served_rows_join_the_two_reports_per_entry():
    rows = qs.served_rows(_served())
    assert rows == [
        ["bfloat16", "16 / 16 (bf16)", "n/a", "24576", "24576", "0", "0", "0.750", "0.750", "1 / 0"],
        ["b-loopvq", "0.5 / 0.5", "768", "4116", "1140", "0.10660", "+7.43%", "0.500", "0.250", "0 / 1"],
    ]


def test_the_ranking_sentence_follows_the_stored_numbers():
    served = qs.read_served()
    study = json.loads(rr.STUDY.read_text())
    text = " ".join(qs.ranking(served, study).split())
    here = {b["name"]: b["eval_kl"] for b in served["report"]["bundles"]}
    expected = "ahead of" if here["tiny-ouro-tasq+loopvq-0.5bit"] < here["tiny-ouro-loopvq-0.5bit"] else "behind"
    assert text.startswith(f"At 0.5 bit TaSQ+LoopVQ is {expected} LoopVQ here")
    swapped = copy.deepcopy(served)
    for b in swapped["report"]["bundles"]:  # make TaSQ+LoopVQ clearly worse in the served setup
        if b["name"] == "tiny-ouro-tasq+loopvq-0.5bit":
            b["eval_kl"] = 1.0
    assert " ".join(qs.ranking(swapped, study).split()).startswith("At 0.5 bit TaSQ+LoopVQ is behind LoopVQ here")
