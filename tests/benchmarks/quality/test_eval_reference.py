"""benchmarks/quality/eval_reference.py: the runs behind each row of docs/quality-models.md (every method, width and
fine-tuning once; a k-means-only run shares its twin's codebooks) and (slow) a whole tiny run whose report and
setup.json benchmarks/quality/quality_table.py reads back."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
from conftest import ROOT

from benchmarks.quality import eval_reference as er, quality_table as qt
from loopvq_calib.calibration.fingerprints import RunFacts, stage_fingerprints
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import FinetuneConfig


def test_every_method_width_and_fine_tuning_once_and_a_k_means_only_run_reuses_its_twins_codebooks():
    """20 runs; the twin's config differs only in fine-tuning and the bundle's name, so its data, TaSQ and k-means
    stages have the same fingerprints (the pipeline reuses them) and its fine-tuning and bundle do not; the channels
    variant is TaSQ+LoopVQ with the channel grouping under its own name."""
    runs = er.plan()
    assert len({r.name for r in runs}) == len(runs) == 20
    assert {(r.method, r.bits, r.finetuned) for r in runs} == {
        (m, b, t) for m in er.METHODS for b in (0.5, 0.25) for t in (True, False)
    }
    tuned, kmeans = (load_config(er.run_config("huginn", er.Run("tasq+loopvq", 0.25, t))) for t in (True, False))
    assert tuned.finetune.enabled and not kmeans.finetune.enabled
    assert (tuned.model.name_or_path, tuned.data.dataset) == (
        str(ROOT / "artifacts/tiny-huginn"),
        str(ROOT / "artifacts/data/python-calib.jsonl"),
    )
    assert (tuned.quant.group_size, tuned.quant.codebook_size, tuned.quant.steps_per_block) == (32, 256, 4)
    facts = RunFacts(model_identity={"model": "m"}, loop_steps=8, tokenizer_files="tokenizer", data_sources=[])
    a, b = (stage_fingerprints(c, facts) for c in (tuned, kmeans))
    assert [s for s in a if a[s] == b[s]] == ["data", "capture", "tasq", "kmeans"]
    free, channels = (
        load_config(er.run_config("ouro", er.Run(m, 0.5, True))) for m in ("tasq+loopvq", "tasq+loopvq-channels")
    )
    assert free.quant == channels.quant and free.quant.method == "tasq+loopvq"
    assert (free.tasq.grouping, channels.tasq.grouping) == ("free", "channels")
    assert channels.output.bundle_name == "tiny-ouro-tasq+loopvq-channels-0.5bit"


@pytest.mark.slow  # two toy calibrations and a loopvq-eval of 4 entries on 128-token windows: about 30 s on 2 cores
def test_a_tiny_run_writes_what_the_quality_table_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(
        er, "DATA", {"num_sequences": 4, "sequence_length": 128, "heldout_sequences": 1, "sink_tokens": 8}
    )
    monkeypatch.setattr(er, "KMEANS", {"iterations": 2})
    monkeypatch.setattr(er, "FINETUNE", {"epochs": 1})
    monkeypatch.setattr(er, "BASELINES", "fp8")
    monkeypatch.setattr(er, "EVAL_LENGTH", 128)
    out = tmp_path / "results" / "eval-reference-ouro"
    argv = [
        "--model",
        "ouro",
        "--methods",
        "loopvq",
        "--widths",
        "0.5",
        "--limit",
        "1",
        "--passkey-lengths",
        "",
        "--kl-sequences",
        "1",
        "--workers",
        "1",
        "--runs",
        str(tmp_path / "runs"),
        "--out",
        str(out),
    ]
    assert er.main(argv) == 0
    codebooks = next(p for p in (tmp_path / "runs" / "loopvq-0.5" / "kmeans").iterdir() if p.is_file())
    assert os.path.samefile(codebooks, tmp_path / "runs" / "loopvq-0.5-kmeans" / "kmeans" / codebooks.name)
    result = qt.load("ouro", tmp_path / "results")
    names = [e["name"] for e in result["report"]["served"]["entries"]]
    assert names == ["bfloat16", "tiny-ouro-loopvq-0.5bit", "tiny-ouro-loopvq-0.5bit-kmeans", "fp8"]
    setup = result["setup"]
    assert setup["command"].startswith("python benchmarks/quality/eval_reference.py --model ouro --methods loopvq ")
    assert [b["name"] for b in setup["bundles"]] == names[1:3] and setup["bundles"][1]["finetuned"] is False
    assert (setup["heldout"], setup["calibration"]["dataset"]) == (
        "artifacts/data/shakespeare-heldout.jsonl",
        "artifacts/data/shakespeare-calib.jsonl",
    )
    assert setup["calibration"]["finetune"] == asdict(FinetuneConfig(epochs=1)) and setup["commit"]
    assert [row[:3] for row in qt.rows(result)] == [
        ["bfloat16", "16 / 16", ""],
        ["LoopVQ", "0.5 / 0.5", "yes"],
        ["LoopVQ", "0.5 / 0.5", "no"],
        ["fp8", "8 / 8", ""],
    ]
    assert result["report"]["data"]["sequence_length"] == 128
    assert (out / "accuracy_vs_bytes.png").is_file() and setup["seconds"]["loopvq-eval"] > 0
