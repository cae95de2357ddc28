"""The fine-tuning recipe's options (docs/finetune.md): the learning-rate schedule, the proximal penalty, the
affine parameterisation and the codewords trained under min_usage."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import make_tiny_ouro, run_finetune
from support.builders import random_quantizer

from loopvq_calib.calibration.finetune.recipe import CodebookParams, lr_factor
from loopvq_calib.calibration.finetune.train import TeacherCache, usage_counts
from loopvq_calib.codes.objective import teacher
from loopvq_calib.config.schema import FinetuneConfig


def test_lr_factor_by_hand():
    assert [lr_factor(s, 6, 2, schedule="constant") for s in range(6)] == [0.5, 1, 1, 1, 1, 1]
    assert [lr_factor(s, 6, 2, schedule="linear") for s in range(6)] == [0.5, 1, 1, 0.75, 0.5, 0.25]
    cos = [lr_factor(s, 6, 2, schedule="cosine") for s in range(6)]
    assert cos[:3] == [0.5, 1, 1] and cos[3] == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert cos[5] == pytest.approx((1 + math.cos(3 * math.pi / 4)) / 2)
    assert lr_factor(0, 4, 0, schedule="cosine") == 1.0


def test_schedule_sets_the_step_size(tiny_setup):
    """Adam's first step moves every used entry by about lr x factor (m / sqrt(v) = sign(g)): with 4
    warm-up steps the first step moves entries by lr / 4."""
    init = tiny_setup[2]
    for warmup, factor in ((0, 1.0), (4, 0.25)):
        _, seen = run_finetune(tiny_setup, epochs=1, lr=1e-2, warmup_steps=warmup, select_every=1, lr_schedule="cosine")
        step1 = seen[1][1]
        moved = max((step1.codecs[k].codebook - c.codebook).abs().max().item() for k, c in init.codecs.items())
        assert moved == pytest.approx(1e-2 * factor, rel=0.02)


def test_proximal_penalty_value_and_gradient_by_hand():
    """weight x sum ||C - C0||^2 / sum ||C0||^2, gradient 2 weight (C - C0) / sum ||C0||^2."""
    q = random_quantizer(make_tiny_ouro().kv_layout())
    free = CodebookParams(q, "codewords")
    c0 = {k: c.detach().clone() for k, c in free.init.items()}
    norm = sum(c.pow(2).sum() for c in c0.values())
    delta = {k: torch.randn_like(c) * 0.1 for k, c in c0.items()}
    with torch.no_grad():
        for k, p in free.words.items():
            p.add_(delta[k])
    pen = free.penalty(3.0)
    torch.testing.assert_close(pen, 3.0 * sum(d.pow(2).sum() for d in delta.values()) / norm)
    pen.backward()
    for k, p in free.words.items():
        torch.testing.assert_close(p.grad, 6.0 * delta[k] / norm)


def test_proximal_penalty_keeps_codebooks_near_kmeans(tiny_setup):
    init = tiny_setup[2]

    def moved(seen):  # squared distance of the last step's codebooks from the k-means ones
        return sum((seen[-1][1].codecs[k].codebook - c.codebook).pow(2).sum().item() for k, c in init.codecs.items())

    _, free = run_finetune(tiny_setup, epochs=1, lr=3e-2, select_every=3, proximal=0.0)
    _, held = run_finetune(tiny_setup, epochs=1, lr=3e-2, select_every=3, proximal=1e4)
    assert 0 < moved(held) < 0.5 * moved(free)


def test_affine_parameterisation_keeps_codewords_affine_in_kmeans(tiny_setup):
    """affine: each codebook (per head and group) becomes a * C0 + b with one scale and one shift per
    coordinate: 2G free numbers per codebook; regressing C on C0 coordinate-wise leaves no residual."""
    init = tiny_setup[2]
    free = CodebookParams(copy.deepcopy(init), "affine")
    cb = next(iter(init.codecs.values())).codebook
    assert sum(p.numel() for p in free.params) == 2 * sum(c.codebook[:, :, 0].numel() for c in init.codecs.values())
    assert free.params[0].shape == (cb.shape[0], cb.shape[1], 1, cb.shape[3])
    _, seen = run_finetune(tiny_setup, epochs=1, lr=5e-2, parameterization="affine", select_every=3)
    changed = 0
    for key, c0 in init.codecs.items():
        c = seen[-1][1].codecs[key].codebook
        x, y = c0.codebook, c
        xm, ym = x.mean(2, keepdim=True), y.mean(2, keepdim=True)
        a = ((x - xm) * (y - ym)).sum(2, keepdim=True) / (x - xm).pow(2).sum(2, keepdim=True)
        torch.testing.assert_close(y, a * (x - xm) + ym, rtol=1e-4, atol=1e-5)
        changed += int(not torch.equal(c, x))
    assert changed > 0


def test_min_usage_trains_only_codewords_used_enough(tiny_setup):
    """Usage = nearest-codeword counts of the training sequences' group vectors (after the sinks) under
    the k-means codebooks; entries below min_usage stay exactly as they were, others move."""
    model, calib, init = tiny_setup
    counts = usage_counts(
        model,
        calib,
        init,
        cache=TeacherCache(model, FinetuneConfig(), [[i] for i in range(4)]),
        device=torch.device("cpu"),
    )
    key = "key.b0.l0"
    codec = init.codecs[key]
    hand = torch.zeros(codec.codebook.shape[:3], dtype=torch.long)
    for i in calib.train:
        fp = teacher(model, calib.input_ids[i : i + 1])
        x = torch.stack([fp.keys[s][0, 4:] for s in codec.layout.sites], 1)
        idx = codec.encode(x).indices.long()  # [N, H, n]; no sharing: codebook [H, n, K, G]
        for h in range(idx.shape[1]):
            for g in range(idx.shape[2]):
                hand[h, g] += torch.bincount(idx[:, h, g], minlength=hand.shape[2])
    assert torch.equal(counts[key], hand) and counts[key].sum() == 3 * 20 * idx.shape[1] * idx.shape[2]
    threshold = int(counts[key].float().median().item()) + 1
    result, seen = run_finetune(tiny_setup, epochs=1, lr=3e-2, min_usage=threshold, select_every=3)
    for k, c0 in init.codecs.items():
        rare = counts[k] < threshold
        after = seen[-1][1].codecs[k].codebook
        assert torch.equal(after[rare], c0.codebook[rare])
    assert not torch.equal(
        seen[-1][1].codecs[key].codebook[~(counts[key] < threshold)], codec.codebook[~(counts[key] < threshold)]
    )
