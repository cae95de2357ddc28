"""configs/tiny-ouro-reference.yaml: the config the fine-tuning gain is measured with (docs/finetune.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from conftest import ROOT
from transformers import AutoTokenizer

from benchmarks.quality import finetune_grids as grids
from loopvq_calib.config.load import load_config
from loopvq_calib.data.corpus import build_calibration_set

REFERENCE = ROOT / "configs" / "tiny-ouro-reference.yaml"
DEMO = ROOT / "configs" / "tiny-ouro.yaml"


def test_reference_config_uses_every_window_of_the_calibration_plays(reference_model_dir, calib_corpus):
    cfg = load_config(REFERENCE)
    assert Path(cfg.data.dataset).resolve() == calib_corpus.resolve()
    assert Path(cfg.model.name_or_path).resolve() == reference_model_dir.resolve()
    tokenizer = AutoTokenizer.from_pretrained(reference_model_dir)
    text = "".join(json.loads(line)["text"] for line in calib_corpus.read_text().splitlines())
    windows = len(tokenizer(text)["input_ids"]) // cfg.data.sequence_length  # counted independently of data.py
    calib = build_calibration_set(cfg.data, tokenizer)
    assert calib.input_ids.shape == (cfg.data.num_sequences, cfg.data.sequence_length) == (windows, 512)
    assert len(calib.heldout) == 16 and len(calib.train) == windows - 16
    assert not set(calib.train) & set(calib.heldout)
    assert len({tuple(row.tolist()) for row in calib.input_ids}) == windows  # distinct windows, none repeated


def test_reference_config_is_the_demo_setup_at_full_budget():
    """Same model, codebooks, calibration text, sinks and serving as the README demo; the fine-tuning recipe
    (learning rate, schedule, penalty) is the shipped default and runs in fp32 like loopvq-eval."""
    ref, demo = load_config(REFERENCE), load_config(DEMO)
    assert asdict(ref.model) == asdict(demo.model) and asdict(ref.quant) == asdict(demo.quant)
    assert ref.data.dataset == demo.data.dataset and ref.data.sink_tokens == demo.data.sink_tokens
    assert asdict(ref.output.serving) == asdict(demo.output.serving)
    default = load_config({}).finetune
    for key in ("lr", "lr_schedule", "warmup_steps", "proximal", "batch_size", "parameterization", "min_usage"):
        assert getattr(ref.finetune, key) == getattr(default, key), key
    assert ref.finetune.autocast == "none" and ref.model.dtype == "float32"
    assert ref.finetune.epochs == 6 and ref.kmeans.iterations == 100


def test_ouro_2_6b_configs_ship_the_studied_batch2_recipe():
    """The four Ouro-2.6B configs fine-tune with the batch-2 variant the study measured
    (benchmarks/quality/finetune_grids.py ``proximal1-batch2-lr2e-2``, docs/finetune.md "Batch 2")."""
    studied = {**grids.PAPER, **grids.VARIANTS["proximal1-batch2-lr2e-2"]}
    paths = sorted((ROOT / "configs").glob("ouro-2.6b*.yaml"))
    assert len(paths) == 4
    for path in paths:
        ft = load_config(path).finetune
        assert {key: getattr(ft, key) for key in studied} == studied, path.name
