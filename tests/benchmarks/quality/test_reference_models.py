"""benchmarks/quality/reference_models.py, the table every quality benchmark runs on: each shipped model's settings
against its folder and text, the calibration windows its tokenizer cuts, the reference setup's overrides against
configs/tiny-ouro-reference.yaml."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from benchmarks.quality import eval_reference as er, reference_models as refs
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import DataConfig
from loopvq_calib.data.corpus import build_calibration_set
from loopvq_calib.data.files import DataError


def test_the_settings_table_matches_the_shipped_models():
    """T_c 4 divides each model's loops (1 block on Ouro, 2 on Huginn), the texts exist and differ, the passkey's
    longest prompt and its answer fit the model's window, G 16 / 32 at 0.5 / 0.25 bit; ouro-python is built outside
    artifacts/."""
    assert refs.SHIPPED_MODELS == ("ouro", "huginn") and not refs.MODELS["ouro-python"].folder.startswith("artifacts")
    lengths = [int(n) for n in er.parser().parse_args([]).passkey_lengths.split(",")]
    blocks = {}
    for name in refs.SHIPPED_MODELS:
        ref = refs.MODELS[name]
        config = json.loads((ROOT / ref.folder / "config.json").read_text())
        loops = config.get("total_ut_steps", config.get("mean_recurrence"))
        window = config.get("max_position_embeddings", config.get("block_size"))
        assert loops % ref.steps_per_block == 0 and ref.steps_per_block == 4, name
        blocks[name] = loops // ref.steps_per_block
        assert (ROOT / ref.calibration).is_file() and (ROOT / ref.heldout).is_file() and ref.calibration != ref.heldout
        assert max(lengths) + 8 <= window, name
        assert {b: ref.group_size(b) for b in er.WIDTHS} == er.WIDTHS == {0.5: 16, 0.25: 32}
    assert blocks == {"ouro": 1, "huginn": 2}


def test_reference_overrides_on_188_windows_are_the_ouro_reference_config():
    """The reference setup of the gain measurement, applied to the Ouro demo config at the 188 windows the shipped
    tokenizer cuts, is configs/tiny-ouro-reference.yaml (but its run folder)."""
    got = load_config(ROOT / "configs" / "tiny-ouro.yaml", refs.reference_overrides(188)).to_dict()
    want = load_config(ROOT / "configs" / "tiny-ouro-reference.yaml").to_dict()
    got["output"].pop("dir"), want["output"].pop("dir")
    assert got == want


def test_calibration_windows_are_what_the_data_stage_can_cut():
    for name in refs.SHIPPED_MODELS:
        model = refs.MODELS[name]
        windows = refs.calibration_windows(model)
        tokenizer = AutoTokenizer.from_pretrained(ROOT / model.folder)

        def cut(n: int, model=model, tokenizer=tokenizer):
            return build_calibration_set(
                DataConfig(
                    dataset=str(ROOT / model.calibration), num_sequences=n, sequence_length=512, heldout_sequences=0
                ),
                tokenizer,
            )

        assert cut(windows).input_ids.shape == (windows, 512), name
        with pytest.raises(DataError, match="windows"):
            cut(windows + 1)
