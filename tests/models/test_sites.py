"""The loop-site interface: site tables of the real configs, observation, Fisher probes, substitution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_huginn, make_tiny_ouro
from transformers import AutoModelForCausalLM

from loopvq_calib.models import HuginnConfig, KVRecorder, KVSubstituter, OuroConfig, kv_hook, kv_layout

OURO_REAL = dict(
    vocab_size=49152,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=16,
    rope_theta=1e6,
    total_ut_steps=4,
)


@pytest.mark.parametrize(
    "config,sites,heads,head_dim,style",
    [
        (OuroConfig(num_hidden_layers=24, **OURO_REAL), 96, 16, 128, "half"),  # Ouro-1.4B
        (OuroConfig(num_hidden_layers=48, **OURO_REAL), 192, 16, 128, "half"),  # Ouro-2.6B
        (HuginnConfig(), 132, 55, 96, "interleaved"),  # Huginn-0125 at r = 32
    ],
)
def test_kv_sites_of_real_configs_built_without_weights(config, sites, heads, head_dim, style):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kv = kv_layout(model)
    assert (kv.num_sites, kv.kv_heads, kv.head_dim, kv.rope_style) == (sites, heads, head_dim, style)
    assert sorted(s.site for s in kv.sites) == list(range(sites))
    blocks = kv.blocks(4)
    looped = [b for b in blocks if b.steps == 4]
    assert len(looped) == (sites - 4 if style == "interleaved" else sites) // 4


def test_ouro_site_ids_are_step_times_layers_plus_layer():
    kv = make_tiny_ouro().kv_layout()
    assert [(s.site, s.step, s.layer) for s in kv.sites[:3]] == [(0, 0, 0), (1, 0, 1), (2, 1, 0)]
    b = kv.blocks(2)
    assert [tuple(s.site for s in blk.sites) for blk in b] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    with pytest.raises(ValueError, match="blocks of 3"):
        kv.blocks(3)


def test_observed_keys_are_the_k_projection_before_rope():
    model = make_tiny_ouro()
    ids = torch.randint(0, 4096, (1, 9))
    rec = KVRecorder()
    inputs = {}
    handle = model.model.layers[1].self_attn.k_proj.register_forward_hook(
        lambda m, i, o: inputs.setdefault(len(inputs), o.detach())
    )
    with kv_hook(model, rec):
        model(ids)
    handle.remove()
    assert sorted(rec.keys) == list(range(8))
    for step in range(4):  # layer 1 is site step*2 + 1; its k_proj ran once per loop step
        torch.testing.assert_close(rec.keys[step * 2 + 1], inputs[step].view(1, 9, 4, 16))


@pytest.mark.parametrize("make", [make_tiny_ouro, make_tiny_huginn])
def test_substituting_observed_values_changes_nothing_zeros_change_logits(make):
    model = make()
    ids = torch.randint(0, 4096, (2, 11))
    rec = KVRecorder()
    with kv_hook(model, rec):
        base = model(ids).logits
    with kv_hook(model, KVSubstituter.from_tensors({s: (rec.keys[s], rec.values[s]) for s in rec.keys})):
        torch.testing.assert_close(model(ids).logits, base)
    zeros = {s: (torch.zeros_like(k), torch.zeros_like(rec.values[s])) for s, k in rec.keys.items()}
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[:, 5:] = True
    with kv_hook(model, KVSubstituter.from_tensors(zeros, mask)):
        sub = model(ids).logits
    assert (sub - base).abs().max() > 1e-3
    torch.testing.assert_close(sub[:, :5], base[:, :5])  # causal: positions before the replaced ones keep their output


def test_fisher_probes_equal_direct_autograd_through_all_loop_steps():
    model = make_tiny_ouro()
    ids = torch.randint(0, 4096, (1, 8))
    rec = KVRecorder(fisher=True)
    with kv_hook(model, rec):
        logits = model(ids).logits
        F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").backward()
    fisher = rec.fisher()

    # direct: make the site-0 key a leaf and differentiate the same loss
    leaf = rec.keys[0].clone().requires_grad_(True)

    def swap(site, k, v, pos):
        return (leaf, v) if site == 0 else (k, v)

    with kv_hook(model, swap):
        logits = model(ids).logits
    (g,) = torch.autograd.grad(F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"), leaf)
    torch.testing.assert_close(fisher[0][0], g.pow(2))
    assert fisher[0][0].abs().sum() > 0 and fisher[7][1].abs().sum() > 0
