"""benchmarks/quality/quality_table.py: docs/quality-models.md from eval_reference.py's stored results: the rows of a
hand-made report, the paper's ordering checked against an independent rule, a model without results, and the
committed page as the stored results give it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from conftest import ROOT

from benchmarks.quality import quality_table as qt

METHODS = ("cq", "tasq", "loopvq", "tasq+loopvq")
# accuracy per (width, fine-tuned): the paper's order, a tie, a break, all equal
ACCURACY = {
    (0.5, True): (0.25, 0.5, 0.625, 0.75),
    (0.25, True): (0.25, 0.25, 0.5, 0.75),
    (0.5, False): (0.5, 0.25, 0.5, 0.625),
    (0.25, False): (0.5, 0.5, 0.5, 0.5),
}


def _entry(name: str, kind: str, method: str, bits: dict | None, encoded: float | None) -> dict:
    return {
        "name": name,
        "kind": kind,
        "method": method,
        "bits": bits,
        "bytes": {
            "bytes_per_token": 24576.0 if encoded is None else encoded + 3000,
            "encoded_bytes_per_token": encoded,
        },
    }


def results(model: str = "ouro") -> tuple[dict, dict]:
    """A hand-made (report.json, setup.json) pair: full precision, 16 bundles, two baselines."""
    entries = [_entry("bfloat16", "full-precision", "full-precision", None, None)]
    quality, about, scores = [], [], {"bfloat16": 0.875}
    keys = {"bfloat16": {"256": 1.0, "2040": 0.5}}
    for (width, tuned), accs in ACCURACY.items():
        for method, acc in zip(METHODS, accs):
            name = f"tiny-{model}-{method}-{width:g}bit" + ("" if tuned else "-kmeans")
            key_bits = width + (0.042 if "tasq" in method else 0)
            entries.append(_entry(name, "bundle", method, {"key": key_bits, "value": width}, 1536 * width))
            quality.append({"name": name, "eval_kl": acc / 10, "ppl_fp": 66.0, "ppl_quantized": 70 + acc})
            about.append({"name": name, "method": method, "width": width, "finetuned": tuned})
            scores[name], keys[name] = acc, {"256": acc, "2040": 0.0}
    for name, bits, encoded in (("kivi2", 3, 4608.0), ("fp8", 8, 12288.0)):
        entries.append(_entry(name, "baseline", name, {"key": bits, "value": bits}, encoded))
        quality.append({"name": name, "eval_kl": 0.001, "ppl_fp": 66.0, "ppl_quantized": 66.5})
        scores[name], keys[name] = 0.75, {"256": 1.0, "2040": 1.0}
    served = {
        "reference": "bfloat16",
        "entries": entries,
        "tasks": {
            "tasks": ["loopvq_recall"],
            "limit": 24.0,
            "scores": {n: {"loopvq_recall": {"exact_match,answer": v}} for n, v in scores.items()},
        },
        "passkey": {"lengths": [256, 2040], "trials_per_length": 2, "accuracy": keys},
    }
    report = {
        "dtype": "bfloat16",
        "data": {"num_sequences": 8, "sequence_length": 512},
        "bundles": quality,
        "served": served,
    }
    setup = {
        "command": f"python benchmarks/quality/eval_reference.py --model {model}",
        "commit": "abc1234",
        "device": "cpu",
        "cpu_count": 2,
        "heldout": "artifacts/data/shakespeare-heldout.jsonl",
        "bundles": about,
        "seconds": {"calibration": 900.0, "loopvq-eval": 2400.0},
        "calibration": {
            "dataset": "artifacts/data/shakespeare-calib.jsonl",
            "sequences": 16,
            "sequence_length": 512,
            "sink_tokens": 8,
            "codebook_size": 256,
            "group_size": {"0.5": 16, "0.25": 32},
            "steps_per_block": 4,
            "kmeans_iterations": 10,
            "finetune": {"epochs": 4, "lr": 0.01},
            "serving": {"recent_window": 64, "page_size": 8},
        },
    }
    return report, setup


def store(folder: Path, model: str = "ouro") -> Path:
    out = folder / f"eval-reference-{model}"
    out.mkdir(parents=True)
    report, setup = results(model)
    (out / "report.json").write_text(json.dumps(report))
    (out / "setup.json").write_text(json.dumps(setup))
    return out


def test_rows_follow_the_stored_report(tmp_path):
    store(tmp_path)
    table = qt.rows(qt.load("ouro", tmp_path))
    assert len(table) == 1 + 16 + 2
    assert table[0] == ["bfloat16", "16 / 16", "", "0", "66.00", "0.875", "1.00 / 0.50", "24576"]
    assert table[1] == ["CQ", "0.5 / 0.5", "yes", "0.0250", "70.25", "0.250", "0.25 / 0.00", "768"]
    assert table[2] == ["CQ", "0.5 / 0.5", "no", "0.0500", "70.50", "0.500", "0.50 / 0.00", "768"]
    assert table[3][:3] == ["TaSQ", "0.542 / 0.5", "yes"] and table[8][:3] == ["TaSQ+LoopVQ", "0.542 / 0.5", "no"]
    assert table[9][:2] == ["CQ", "0.25 / 0.25"] and table[9][-1] == "384"
    assert table[-2] == ["KIVI 2-bit", "3 / 3", "", "0.0010", "66.50", "0.750", "1.00 / 1.00", "4608"]
    assert table[-1][0] == "fp8"


def _independent_verdict(values: list[float]) -> str:
    """The paper's order holds strictly when the values are sorted and distinct; with ties when sorted only."""
    if len(set(values)) == 1:
        return "all equal"
    if values == sorted(values):
        return "holds" if len(set(values)) == len(values) else "holds with ties"
    return "does not hold"


def test_the_ordering_verdict_agrees_with_an_independent_rule():
    for values in itertools.product((0.0, 0.5, 1.0), repeat=4):
        verdict = qt.ordering(dict(zip(METHODS, values)))
        assert verdict.startswith(_independent_verdict(list(values)) + " ("), (values, verdict)
    assert qt.ordering(dict(zip(METHODS, (0.1, 0.2, 0.2, 0.15)))) == (
        "does not hold (CQ 0.100 < TaSQ 0.200 = LoopVQ 0.200 > TaSQ+LoopVQ 0.150)"
    )


def test_the_ordering_line_covers_each_width_fine_tuned_and_k_means_only(tmp_path):
    store(tmp_path)
    line = qt.ordering_line(qt.load("ouro", tmp_path))
    expected = [
        f"{w:g} bit {'fine-tuned' if t else 'k-means only'}: {_independent_verdict(list(ACCURACY[w, t]))} ("
        for t in (True, False)
        for w in (0.5, 0.25)
    ]
    assert [line.index(e) for e in expected] == sorted(line.index(e) for e in expected)
    assert "0.5 bit fine-tuned: holds (CQ 0.250 < TaSQ 0.500 < LoopVQ 0.625 < TaSQ+LoopVQ 0.750)" in line
    report, setup = results()
    setup["bundles"] = [b for b in setup["bundles"] if b["method"] != "tasq"]
    partial = qt.ordering_line({"report": report, "setup": setup})
    assert partial.endswith("not measured (a method or width is missing).")


def test_a_page_with_one_model_measured_and_one_not(tmp_path):
    folder = store(tmp_path / "results")
    (folder / "accuracy_vs_bytes.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    page = tmp_path / "docs" / "quality-models.md"
    page.parent.mkdir()
    qt.write_page(page, results=tmp_path / "results")
    text = page.read_text()
    ouro, huginn = text.split("## `artifacts/tiny-huginn`")
    assert "10 M-parameter reference models" in text and "Not measured yet" not in ouro
    assert "python benchmarks/quality/eval_reference.py --model ouro\n```" in ouro and "`abc1234`" in ouro
    assert "| TaSQ+LoopVQ | 0.292 / 0.25 | no |" in ouro and "The paper on Ouro-1.4B" in ouro
    assert "(../results/eval-reference-ouro/accuracy_vs_bytes.png)" in ouro
    assert "Not measured yet" in huginn and "python benchmarks/quality/eval_reference.py --model huginn" in huginn
    assert "The paper on Huginn-3.5B" in huginn and "0.25 bit CQ 12.9 / TaSQ 13.0 / LoopVQ 18.6" in huginn
    store(tmp_path / "results", "huginn")
    qt.write_page(page, results=tmp_path / "results")
    assert len(page.read_text().splitlines()) <= 300 and "Not measured yet" not in page.read_text()


def test_the_committed_page_is_the_one_the_stored_results_give():
    page = qt.render({m: qt.load(m) for m in qt.MODELS}, page_dir=ROOT / "docs")
    assert page == (ROOT / "docs" / "quality-models.md").read_text()


def test_a_channels_row_follows_tasq_loopvq_under_its_own_name_and_the_ordering_still_reads(tmp_path):
    out = store(tmp_path)
    report, setup = (json.loads((out / f).read_text()) for f in ("report.json", "setup.json"))
    name = "tiny-ouro-tasq+loopvq-channels-0.5bit"
    report["served"]["entries"].append(_entry(name, "bundle", "tasq+loopvq", {"key": 0.542, "value": 0.5}, 768.0))
    report["bundles"].append({"name": name, "eval_kl": 0.07, "ppl_fp": 66.0, "ppl_quantized": 70.9})
    report["served"]["tasks"]["scores"][name] = {"loopvq_recall": {"exact_match,answer": 0.9}}
    report["served"]["passkey"]["accuracy"][name] = {"256": 1.0, "2040": 0.5}
    setup["bundles"].append({"name": name, "method": "tasq+loopvq-channels", "width": 0.5, "finetuned": True})
    (out / "report.json").write_text(json.dumps(report))
    (out / "setup.json").write_text(json.dumps(setup))
    result = qt.load("ouro", tmp_path)
    table = qt.rows(result)
    assert [r[0] for r in table[7:10]] == ["TaSQ+LoopVQ", "TaSQ+LoopVQ", "TaSQ+LoopVQ (channels)"]
    assert table[9][2:6] == ["yes", "0.0700", "70.90", "0.900"]
    line = qt.ordering_line(result)
    assert "0.5 bit fine-tuned: holds (CQ 0.250 < TaSQ 0.500 < LoopVQ 0.625 < TaSQ+LoopVQ 0.750)" in line
