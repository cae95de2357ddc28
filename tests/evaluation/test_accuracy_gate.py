"""The served accuracy gate can fail: ``loopvq-eval --max-accuracy-drop`` on a deliberately broken bundle of the
Huginn reference model, which answers the shipped ``loopvq_recall`` items from its cache, exits 1."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA, ROOT, needs_lm_eval
from support.quantizers import sampled_quantizer

from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.cli import eval_main
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.models.loading import load_model, model_identity

HUGINN_REFERENCE = ROOT / "artifacts" / "tiny-huginn"
METRIC = "exact_match,answer"


@pytest.fixture(scope="module")
def broken_bundle(tmp_path_factory: pytest.TempPathFactory):
    """A valid bundle whose codebooks are all zero: every coded key and value past the sinks and the recent
    window decodes to 0, so the evidence of a recall item (at least 128 tokens before its question) is gone."""
    model, tok = load_model(HUGINN_REFERENCE, "float32", torch.device("cpu"))
    ids = torch.tensor([tok("The grass is green. The sky is blue. " * 4)["input_ids"][:32]])
    quantizer = sampled_quantizer(model, ids, "loopvq", codebook_size=16, group_size=16, steps_per_block=4)
    for codec in quantizer.codecs.values():
        codec.codebook.zero_()
    out = tmp_path_factory.mktemp("gate") / "zeroed"
    return write_bundle(
        out,
        quantizer,
        name="zeroed-codebooks",
        identity=model_identity(HUGINN_REFERENCE, str(HUGINN_REFERENCE)),
        calibration={},
        metrics={},
        serving=ServingConfig(sink_tokens=8, recent_window=64, page_size=8),
        codebook_dtype="float32",
        config={},
        producer_version="test",
    )


@needs_lm_eval
def test_accuracy_gate_fails_on_a_broken_bundle(broken_bundle, tmp_path, capsys):
    """Full precision answers the first three items (pass key, registry, copy at up to 256 tokens); the zeroed
    bundle answers none, so a 0.2 drop limit fails with exit 1 and names the entry and the task."""
    out = tmp_path / "eval"
    argv = ["--bundle", str(broken_bundle), "--data", str(DATA / "shakespeare-heldout.jsonl"), "--device", "cpu"]
    argv += ["--num-sequences", "1", "--sequence-length", "64", "--tasks", "loopvq_recall", "--limit", "3"]
    assert eval_main(argv + ["--max-accuracy-drop", "0.2", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "gate failed: zeroed-codebooks: loopvq_recall accuracy drop" in printed
    served = json.loads((out / "report.json").read_text())["served"]
    scores = {name: s["loopvq_recall"][METRIC] for name, s in served["tasks"]["scores"].items()}
    assert scores == {"float32": 1.0, "zeroed-codebooks": 0.0}
    assert served["accuracy_drop"]["zeroed-codebooks"]["loopvq_recall"] == pytest.approx(1.0)
