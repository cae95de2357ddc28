"""Native Huginn: spec fidelity, recurrence argument, initial state, cached decode, hub checkpoint layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_huginn
from safetensors.torch import load_file, save_file
from support.quantizers import sampled_quantizer
from transformers import AutoModelForCausalLM

from loopvq_calib.calibration.capture.kv import capture_sequence
from loopvq_calib.calibration.finetune.train import sequence_kl
from loopvq_calib.codes.objective import mean_kl, teacher
from loopvq_calib.config.schema import FinetuneConfig
from loopvq_calib.evaluation.evaluate import evaluate_quantizers
from loopvq_calib.models import HuginnForCausalLM, LoopKVCache
from loopvq_calib.models.huginn import sequence_seed


def reference_huginn_logits(sd: dict, cfg, ids: torch.Tensor, r: int, state: torch.Tensor) -> torch.Tensor:
    """Eager functional Huginn from docs/architectures.md (Huginn: forward pass, attention) (interleaved RoPE,
    sandwich blocks)."""
    d, h = cfg.n_embd, cfg.n_heads
    hd = d // h
    b, s = ids.shape
    inv = 1.0 / cfg.rope_base ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(s).float()[:, None] * inv
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # [s, 1, hd/2]

    def rope(x):  # [b, s, h, hd] complex-pair convention
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(-2)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps))

    def block(x, p):
        a = rms(x, sd[p + "norm_1.weight"])
        q, k, v = (a @ sd[p + "attn.Wqkv.weight"].T).split(d, -1)
        q = q.view(b, s, h, hd) + sd[p + "attn.qk_bias"][0]
        k = k.view(b, s, h, hd) + sd[p + "attn.qk_bias"][1]
        q, k, v = rope(q).transpose(1, 2), rope(k).transpose(1, 2), v.view(b, s, h, hd).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + torch.full((s, s), -math.inf).triu(1), -1) @ v
        x = rms(x + att.transpose(1, 2).reshape(b, s, d) @ sd[p + "attn.proj.weight"].T, sd[p + "norm_2.weight"])
        m = rms(x, sd[p + "norm_3.weight"]) @ sd[p + "mlp.fc.weight"].T
        g, u = m.chunk(2, -1)
        return rms(x + (F.silu(g) * u) @ sd[p + "mlp.proj.weight"].T, sd[p + "norm_4.weight"])

    e = sd["transformer.wte.weight"][ids] * math.sqrt(d)
    for i in range(cfg.n_layers_in_prelude):
        e = block(e, f"transformer.prelude.{i}.")
    x = state
    for _ in range(r):
        x = torch.cat([x, e], -1) @ sd["transformer.adapter.weight"].T
        for j in range(cfg.n_layers_in_recurrent_block):
            x = block(x, f"transformer.core_block.{j}.")
    x = rms(x, sd["transformer.ln_f.weight"])
    for k in range(cfg.n_layers_in_coda):
        x = block(x, f"transformer.coda.{k}.")
    return rms(x, sd["transformer.ln_f.weight"]) @ sd["transformer.wte.weight"].T


@pytest.mark.parametrize("r", [1, 3])
def test_forward_matches_spec_reference(r):
    model = make_tiny_huginn()
    ids = torch.randint(0, 4096, (2, 10))
    state = torch.randn(2, 10, 64)
    ours = model(ids, num_steps=r, input_states=state).logits
    ref = reference_huginn_logits(model.state_dict(), model.config, ids, r, state)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert ours.dtype == torch.float32


def test_kv_sites_follow_the_flat_layout():
    kv = make_tiny_huginn().kv_layout(num_steps=3)
    assert kv.num_sites == 1 + 2 * 3 + 1 and kv.rope_style == "interleaved"
    assert [s.stage for s in kv.sites] == ["prelude"] + ["loop"] * 6 + ["coda"]
    assert [(s.site, s.step, s.layer) for s in kv.sites if s.looped][-1] == (6, 2, 1)


def test_cached_decode_equals_full_forward_with_zero_state():
    model = make_tiny_huginn()  # state_init "zero": deterministic
    ids = torch.randint(0, 4096, (1, 12))
    full = model(ids).logits
    cache = LoopKVCache()
    parts = [model(ids[:, :4], cache=cache).logits] + [
        model(ids[:, i : i + 1], cache=cache).logits for i in range(4, 12)
    ]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-4)
    assert len(cache) == 1 + 2 * 4 + 1 and cache.num_steps == 4
    with pytest.raises(ValueError, match="loop steps"):
        model(ids[:, :1], cache=cache, num_steps=5)


def test_random_initial_state_by_default_and_settable():
    model = make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (1, 6))
    a, b = model(ids).logits, model(ids).logits
    assert not torch.allclose(a, b)
    zeros = torch.zeros(1, 6, 64)
    torch.testing.assert_close(model(ids, input_states=zeros).logits, model(ids, init_scale=0).logits)
    s = model.initial_state(torch.zeros(1000, 64))
    std = model.config.init_values["std"] * model.config.init_values["embed_scale"]
    assert abs(s.std().item() - std) < 0.1 * std and s.abs().max() <= 3 * std + 1e-6


def test_generate_with_cache_matches_uncached_greedy():
    model = make_tiny_huginn()
    prompt = torch.randint(0, 4096, (1, 5))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ids = prompt
    for _ in range(6):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


def test_hub_checkpoint_with_both_embedding_copies_and_rope_table_loads(tmp_path):
    model = make_tiny_huginn()
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert "freqs_cis" in sd and tuple(sd["freqs_cis"].shape) == (1, 512, 1, 8, 2)
    sd["lm_head.weight"] = sd["transformer.wte.weight"].clone()  # the hub stores the tied embedding twice
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, HuginnForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, 4096, (1, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_checkpoint_without_rope_table_loads(tmp_path):
    make_tiny_huginn().save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd.pop("freqs_cis")
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), HuginnForCausalLM)


def test_seeded_initial_state_is_a_function_of_the_tokens():
    """Inside seeded_initial_state each row's state comes from sequence_seed(its tokens): repeated
    forwards agree, a row alone equals the same row in a batch, other tokens give another state, the
    draw equals a hand-seeded truncated normal, and outside the block the state is random again."""
    model = make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (2, 6))
    e = torch.zeros(2, 6, 64)
    with model.seeded_initial_state():
        a, b = model(ids).logits, model(ids).logits
        alone = model(ids[1:]).logits
        state = model.initial_state(e, input_ids=ids)
        with model.seeded_initial_state(seed=5):  # nested: the outer seed stays
            torch.testing.assert_close(model.initial_state(e, input_ids=ids), state, rtol=0, atol=0)
    assert torch.equal(a, b)
    torch.testing.assert_close(alone[0], a[1])  # same state; batched matmuls may round differently
    std = model.config.init_values["std"]
    gen = torch.Generator().manual_seed(sequence_seed(ids[0]))
    expect = torch.nn.init.trunc_normal_(torch.empty(6, 64), std=std, a=-3 * std, b=3 * std, generator=gen)
    torch.testing.assert_close(state[0], expect * model.config.init_values["embed_scale"], rtol=0, atol=0)
    assert not torch.allclose(state[0], state[1])
    assert sequence_seed(ids[0]) == sequence_seed(ids[0].to(torch.int32)) != sequence_seed(ids[0], seed=1)
    with model.seeded_initial_state(seed=1):
        assert not torch.allclose(model.initial_state(e, input_ids=ids), state)
    assert model._state_seed is None and not torch.allclose(model(ids).logits, a)


def test_like_init_kl_of_an_identity_quantizer_is_exactly_zero_and_reproducible():
    """A quantizer whose codebooks hold every group vector of the sequence reproduces its keys/values;
    under like-init the teacher and quantized forwards share the initial state, so the KL is exactly 0
    (fine-tuning objective and evaluation), and a lossy quantizer's numbers repeat exactly."""
    model = make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (1, 16))
    exact = sampled_quantizer(model, ids, "loopvq", codebook_size=16)
    lossy = sampled_quantizer(model, ids, "loopvq", codebook_size=4)
    assert sequence_kl(model, ids, exact, sink_tokens=2, cfg=FinetuneConfig(), device=torch.device("cpu")).item() == 0.0
    first = evaluate_quantizers(model, ids, [(exact, 2), (lossy, 2)], per_step=False)
    again = evaluate_quantizers(model, ids, [(exact, 2), (lossy, 2)], per_step=False)
    assert first[0]["eval_kl"] == 0.0 and first[0]["nmse"] == {"key": 0.0, "value": 0.0}
    assert first[1]["eval_kl"] > 0 and first[1] == again[1]
    # without a shared state two full-precision forwards already disagree: the noise the fix removes
    assert mean_kl(teacher(model, ids).logits, model(ids).logits, 2).item() > 1e-6


def test_capture_uses_the_teachers_initial_state():
    """The captured keys/values (and so the Fisher's forward) of a like-init model are the teacher's."""
    model = make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (2, 12))
    stored = capture_sequence(model, ids, model.kv_layout(), seqs=[0, 1])
    fp = teacher(model, ids[1:])
    for site in fp.keys:
        torch.testing.assert_close(stored[1][f"key.{site}"], fp.keys[site][0], rtol=0, atol=0)
        torch.testing.assert_close(stored[1][f"value.{site}"], fp.values[site][0], rtol=0, atol=0)


def test_seeded_state_is_drawn_once_for_repeated_forwards(monkeypatch):
    """The teacher and the quantized forward of one sequence reuse the drawn state (one draw, not two)."""
    model = make_tiny_huginn(state_init="like-init")
    ids = torch.randint(0, 4096, (1, 8))
    draws = []
    original = torch.nn.init.trunc_normal_
    monkeypatch.setattr(torch.nn.init, "trunc_normal_", lambda *a, **k: draws.append(1) or original(*a, **k))
    with model.seeded_initial_state():
        a = model(ids).logits
    with model.seeded_initial_state():
        b = model(ids).logits
        model(ids[:, :5])
    assert torch.equal(a, b) and len(draws) == 2
