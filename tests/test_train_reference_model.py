"""scripts/train_reference_model.py: the branch output norms' initial scale, the repeat gain, the short-row warm-up."""

from __future__ import annotations

import argparse

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


def test_the_short_row_warm_up_keeps_the_tokens_per_batch_then_gives_full_rows():
    """``--short-steps 2 --short-seq-len 16`` at ``--seq-len 64 --batch 4``: two batches of 16 rows of 16 tokens,
    then rows of 64; in each, half the rows are windows of the training text, a quarter recall rows, a quarter rows
    of repeated spans (at 16 tokens each a span of 4 followed by itself)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(REFERENCE_MODEL)
    args = argparse.Namespace(
        seed=0, batch=4, seq_len=64, short_seq_len=16, short_steps=2, recall_share=0.25, repeat_share=0.25
    )
    text = np.random.default_rng(0).integers(3, 4096, 5000).astype(np.uint16)
    stream = trm.training_batches(args, text, trm.tokenize_with(tokenizer), gen=torch.Generator().manual_seed(0))
    shapes = []
    for _ in range(3):
        batch = next(stream)
        shapes.append(tuple(batch.shape))
        rows, seq = batch.shape
        windows = {tuple(text[i : i + seq].tolist()) for i in range(len(text) - seq + 1)}
        kinds = [tuple(row.tolist()) in windows for row in batch]
        assert kinds == [True] * (rows // 2) + [False] * (rows // 2)
        recall = tokenizer.decode(batch[rows // 2])
        assert recall.strip(), recall
        if seq == 16:
            assert all(torch.equal(row[:4], row[4:8]) and torch.equal(row[8:12], row[12:]) for row in batch[-4:])
    assert shapes == [(16, 16), (16, 16), (4, 64)]


def test_the_initial_model_has_the_embedding_std_and_a_separate_head_aligned_with_it():
    """``--embed-std 1.0 --head-from-embedding 0.02 --layers 2``: a 2-layer model whose embedding has std about 1 and
    whose LM head equals 0.02 x the embedding, yet is its own tensor (Ouro's head is untied: training moves it
    apart)."""
    args = argparse.Namespace(layers=2, branch_scale=0.1, embed_std=1.0, head_from_embedding=0.02, dropout=0.0)
    model = trm.initial_model(args)
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert len(model.model.layers) == 2
    assert embedding.std().item() == pytest.approx(1.0, rel=0.01)
    assert torch.equal(head, embedding * 0.02)
    assert head.data_ptr() != embedding.data_ptr()
