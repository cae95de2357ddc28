"""Native Ouro: spec fidelity, cached decode, generation, GQA, early exit, checkpoint loading."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_ouro, save_with_tokenizer, tiny_ouro_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loopvq_calib.models import CheckpointMismatchError, LoopKVCache, OuroForCausalLM, common
from loopvq_calib.models.ouro import exit_pdf


def reference_ouro_logits(sd: dict, cfg, ids: torch.Tensor) -> torch.Tensor:
    """Eager functional Ouro written from docs/architectures.md (Ouro: forward pass, attention), by weight name."""

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    b, s = ids.shape
    hd, h, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(s).float()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(x):  # [b, heads, s, hd], rotate_half convention
        return x * cos + torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1) * sin

    x = sd["model.embed_tokens.weight"][ids]
    mask = torch.full((s, s), -math.inf).triu(1)
    for _ in range(cfg.total_ut_steps):
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = rms(x, sd[p + "input_layernorm.weight"])
            q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(b, s, h, hd).transpose(1, 2)
            k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(b, s, kv, hd).transpose(1, 2)
            v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(b, s, kv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
            att = torch.softmax(rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(hd) + mask, -1) @ v
            o = att.transpose(1, 2).reshape(b, s, h * hd) @ sd[p + "self_attn.o_proj.weight"].T
            x = x + rms(o, sd[p + "input_layernorm_2.weight"])
            m = rms(x, sd[p + "post_attention_layernorm.weight"])
            m = (F.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)) @ sd[
                p + "mlp.down_proj.weight"
            ].T
            x = x + rms(m, sd[p + "post_attention_layernorm_2.weight"])
        x = rms(x, sd["model.norm.weight"])
    return x @ sd["lm_head.weight"].T


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_forward_matches_spec_reference(kv_heads):
    model = make_tiny_ouro(num_key_value_heads=kv_heads)
    ids = torch.randint(0, 4096, (2, 12))
    ours = model(ids).logits
    ref = reference_ouro_logits(model.state_dict(), model.config, ids)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
def test_full_forward_equals_token_by_token_decode(dtype, tol):
    model = make_tiny_ouro().to(dtype)
    ids = torch.randint(0, 4096, (2, 16))
    full = model(ids).logits.float()
    cache = LoopKVCache()
    steps = [model(ids[:, :5], cache=cache).logits]
    steps += [model(ids[:, i : i + 1], cache=cache).logits for i in range(5, 16)]
    torch.testing.assert_close(torch.cat(steps, 1).float(), full, rtol=tol, atol=tol)
    assert len(cache) == 2 * 4 and cache.get_seq_length() == 16


def test_generate_uses_cache_and_matches_uncached_greedy():
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (1, 6))
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ids = prompt
    for _ in range(8):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    assert torch.equal(out, ids)


def test_batched_left_padded_generation_equals_single_runs():
    """The hub code's decode mask had the wrong length with padding; ours builds it from past + q."""
    model = make_tiny_ouro()
    a, b = torch.randint(3, 4096, (1, 7)), torch.randint(3, 4096, (1, 4))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, single in ((0, a), (1, b)):
        ref = model.generate(single, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert torch.equal(out[row, -5:], ref[0, -5:])


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = make_tiny_ouro(num_key_value_heads=2)
    mha = OuroForCausalLM(tiny_ouro_config()).eval()
    sd = gqa.state_dict()
    for name, w in list(sd.items()):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            sd[name] = w.view(2, 16, -1).repeat_interleave(2, 0).reshape(4 * 16, -1)
    mha.load_state_dict(sd)
    ids = torch.randint(0, 4096, (1, 10))
    torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, rtol=1e-5, atol=1e-5)


def test_early_exit_readout_semantics():
    model = make_tiny_ouro()
    ids = torch.randint(0, 4096, (1, 9))
    out = model(ids, output_loop_hidden_states=True)
    hidden, gates = out.loop_hidden_states, out.gate_logits
    for t in range(4):
        torch.testing.assert_close(model(ids, exit_at_step=t).logits, model.lm_head(hidden[t]))
    lam = torch.sigmoid(torch.cat(gates, -1))
    pdf = exit_pdf(list(gates))
    manual = [lam[..., 0], (1 - lam[..., 0]) * lam[..., 1], (1 - lam[..., 0]) * (1 - lam[..., 1]) * lam[..., 2]]
    manual.append(1 - sum(manual))
    torch.testing.assert_close(pdf, torch.stack(manual, -1), rtol=1e-5, atol=1e-6)
    threshold = 0.5
    step = (pdf.cumsum(-1) >= threshold).float().argmax(-1)
    expected = torch.stack([model.lm_head(hidden[int(t)][0, j]) for j, t in enumerate(step[0])])
    torch.testing.assert_close(model(ids, early_exit_threshold=threshold).logits[0], expected)
    torch.testing.assert_close(model(ids).logits, model.lm_head(hidden[-1]))  # shipped threshold 1.0


def test_hub_layout_config_with_auto_map_loads_without_remote_code(tmp_path):
    model = make_tiny_ouro()
    save_with_tokenizer(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    }
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, OuroForCausalLM)
    ids = torch.randint(0, 4096, (1, 8))
    torch.testing.assert_close(loaded.float()(ids).logits, model(ids).logits)


def test_sharded_checkpoint_loads(tmp_path):
    model = make_tiny_ouro()
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 4096, (1, 8))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_shipped_reference_model_is_sharded_bf16_ouro(reference_model_dir):
    index = json.loads((reference_model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    model = AutoModelForCausalLM.from_pretrained(reference_model_dir)
    assert isinstance(model, OuroForCausalLM) and model.dtype == torch.bfloat16
    assert model.config.total_ut_steps == 4 and model.kv_layout().num_sites == 16


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors: model.layers.1.mlp.up_proj.weight"),
        (
            lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(2)),
            "unexpected tensors: model.layers.0.extra.weight",
        ),
        (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(63)), "model.norm.weight"),
    ],
)
def test_bad_checkpoint_errors_name_the_tensors(tmp_path, edit, expected):
    make_tiny_ouro().save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    edit(sd)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatchError, match=expected.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_rope_tables_are_computed_once_per_forward(monkeypatch):
    """Every site of a forward rotates at the same positions: the angles are computed once per forward (not
    twice per site, which also cost a host-to-device copy each time), with unchanged outputs."""
    model = make_tiny_ouro()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    sites = model.kv_layout().num_sites
    calls = []
    real = common.rope_angles
    monkeypatch.setattr(common, "rope_angles", lambda *a: calls.append(a[1]) or real(*a))
    logits = model(ids, use_cache=False).logits
    assert len(calls) == 1 and sites > 1

    def per_site_rope(self, x, positions):  # the uncached rule, at every site
        cos, sin = real(positions, x.shape[-1], self.rope_theta)
        return common.apply_rope(x, cos, sin, style=self.rope_style)

    monkeypatch.setattr(common.ForwardContext, "rope", per_site_rope)
    assert torch.equal(model(ids, use_cache=False).logits, logits)
