"""scripts/train_reference_model.py: the branch output norms' initial scale, the repeat gain, prepare with a given
tokenizer."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from conftest import REFERENCE_MODEL, load_script, tiny_ouro_config
from transformers import PreTrainedTokenizerFast

from loopvq_calib.models import OuroForCausalLM
from loopvq_calib.models.common import build_context

trm = load_script("train_reference_model")


def test_scaled_branch_norms_scale_each_branchs_contribution_to_the_residual():
    """Every layer's two branch output norms start at the scale, the other norms at 1; a layer then adds exactly
    scale x the branch output it added at 1 (its attention branch, checked on one layer's forward)."""
    torch.manual_seed(0)
    model = OuroForCausalLM(tiny_ouro_config()).eval()
    layer = model.model.layers[0]
    h = torch.randn(1, 5, 64)
    ctx = build_context(
        5,
        1,
        h.device,
        rope_style="half",
        rope_theta=10000.0,
        cache=None,
        attention_mask=None,
        position_ids=None,
        hook=None,
    )

    def branch() -> torch.Tensor:
        return layer.input_layernorm_2(layer.self_attn(layer.input_layernorm(h), ctx, 0))

    with torch.no_grad():
        before = branch()
        trm.scale_branch_norms(model, 0.1)
        after = branch()
    for lay in model.model.layers:
        assert torch.equal(lay.input_layernorm_2.weight, torch.full((64,), 0.1))
        assert torch.equal(lay.post_attention_layernorm_2.weight, torch.full((64,), 0.1))
        assert torch.equal(lay.input_layernorm.weight, torch.ones(64))
        assert torch.equal(lay.post_attention_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(after, 0.1 * before)


def test_repeat_gain_is_the_first_copys_loss_minus_the_seconds():
    """The gain from the model's last-loop logits on each passage repeated once, computed here by hand."""
    torch.manual_seed(0)
    model = OuroForCausalLM(tiny_ouro_config()).eval()
    tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, 200).astype(np.uint16)
    got = trm.repeat_gain(model, tokens, device="cpu", length=20, windows=3)
    data = torch.from_numpy(tokens[:60].astype(np.int64)).view(3, 20)
    ids = torch.cat([data, data], 1)
    with torch.no_grad():
        logits = model(ids).logits.float()  # the last loop's readout (early-exit threshold 1)
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert got == pytest.approx((nll[:, :19].mean() - nll[:, 20:].mean()).item(), abs=1e-5)


def test_prepare_with_a_given_tokenizer_keeps_it_and_tokenizes_with_it(tmp_path, monkeypatch):
    """``prepare --tokenizer``: the folder's tokenizer is saved unchanged into the model folder and the token ids
    are that tokenizer's (checked by decoding them back to the held-out plays)."""
    plays = tmp_path / "plays"
    plays.mkdir()
    names = [*trm.CALIB_PLAYS, *trm.HELDOUT_PLAYS, "lear_gut.txt"]
    for i, name in enumerate(names):
        (plays / name).write_text(f"Enter the {i}th player. What say you, good friend?\n", encoding="utf-8")
    books = {b: f"In the beginning of {b} was the word." for b in (*trm.KJV_CALIB_BOOKS, "Genesis")}
    monkeypatch.setattr(trm, "shakespeare_dir", lambda: plays)
    monkeypatch.setattr(trm, "kjv_books", lambda: books)
    monkeypatch.setattr(trm, "DATA_DIR", tmp_path / "data")
    args = argparse.Namespace(model_dir=tmp_path / "model", build=tmp_path / "ids", tokenizer=REFERENCE_MODEL, seed=0)
    trm.prepare(args)
    saved = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    assert saved == json.loads((REFERENCE_MODEL / "tokenizer.json").read_text())
    tok = PreTrainedTokenizerFast.from_pretrained(REFERENCE_MODEL)
    held = np.load(tmp_path / "ids" / "heldout_tokens.npy").tolist()
    assert (
        tok.decode(held) == "<|endoftext|>".join((plays / n).read_text() for n in trm.HELDOUT_PLAYS) + "<|endoftext|>"
    )
    train = np.load(tmp_path / "ids" / "train_tokens.npy").tolist()
    assert tok.decode(train).count("<|endoftext|>") == 2  # lear and Genesis
