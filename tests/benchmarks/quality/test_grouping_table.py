"""benchmarks/quality/grouping_table.py: docs/tasq.md's free-vs-channels table from stored grouping runs."""

from __future__ import annotations

import json

from benchmarks.quality import grouping_table as gt, reference_models as refs

KL = {
    ("tasq+loopvq", 0.5, True): 0.08,
    ("tasq+loopvq-channels", 0.5, True): 0.1,
    ("tasq+loopvq", 0.25, False): 0.2,
    ("tasq+loopvq-channels", 0.25, False): 0.19,
}


def store(results, model: str = "ouro") -> None:
    """A grouping run of ``model`` with the bundles of KL, as eval_reference.py stores it."""
    folder = results / f"tasq-grouping-{model}"
    folder.mkdir(parents=True)
    bundles = [{"name": f"b{i}", "method": m, "width": w, "finetuned": f} for i, (m, w, f) in enumerate(KL)]
    setup = {
        "command": "python benchmarks/quality/eval_reference.py --model ouro",
        "commit": "abc1234",
        "device": "cpu",
        "cpu_count": 2,
        "heldout": "held.jsonl",
        "calibration": {"codebook_size": 256, "steps_per_block": 4},
        "bundles": bundles,
    }
    report = {"bundles": [{"name": b["name"], "eval_kl": kl} for b, kl in zip(bundles, KL.values())]}
    (folder / "setup.json").write_text(json.dumps(setup))
    (folder / "report.json").write_text(json.dumps(report))


def test_rows_set_each_grouping_beside_the_other_with_channels_excess(tmp_path):
    store(tmp_path)
    result = gt.load("ouro", tmp_path)
    assert gt.rows(result) == [
        ["0.5", "yes", "0.0800", "0.1000", "+25.00 %"],
        ["0.25", "no", "0.2000", "0.1900", "-5.00 %"],
    ]
    section = gt.model_section("ouro", result)
    assert "`python benchmarks/quality/eval_reference.py --model ouro` at `abc1234` on cpu (2 cores)" in section
    assert gt.model_section("huginn", gt.load("huginn", tmp_path)).endswith("not measured yet.")


def test_results_of_replaced_weights_say_so_and_name_the_commit(tmp_path, monkeypatch):
    store(tmp_path, "ouro")
    store(tmp_path, "huginn")
    monkeypatch.setattr(refs, "EARLIER_WEIGHTS", {"tasq-grouping-huginn": ("huginn", "abc1234")})
    huginn = gt.model_section("huginn", gt.load("huginn", tmp_path))
    assert "previous weights of `artifacts/tiny-huginn`** (shipped in `abc1234`)" in " ".join(huginn.split())
    assert "previous weights" not in gt.model_section("ouro", gt.load("ouro", tmp_path))
    assert refs.earlier_weights_note("tasq-grouping-ouro") == ""


def test_the_page_is_written_from_the_stored_results(tmp_path):
    store(tmp_path)
    page = tmp_path / "tasq-grouping.md"
    gt.write_page(page, results=tmp_path)
    text = page.read_text()
    assert text.startswith("# TaSQ+LoopVQ: `free` against `channels` grouping\n")
    assert (
        "| 0.5 | yes | 0.0800 | 0.1000 | +25.00 % |" in text
        and "**`artifacts/tiny-huginn`**: not measured yet." in text
    )


def test_the_shipped_page_is_the_stored_results_table():
    """docs/tasq-grouping.md is what the script writes from benchmarks/results/ today."""
    assert gt.PAGE.read_text() == gt.render({m: gt.load(m) for m in gt.SHIPPED_MODELS})
