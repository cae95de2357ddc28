"""scripts/make_random_checkpoint.py: real configs (parameter counts of the published checkpoints) and a
loadable hub-layout folder."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import load_script

from loopvq_calib.models.loading import load_model, read_model_config

mrc = load_script("make_random_checkpoint")


@pytest.mark.parametrize("name, params", [("ouro-1.4b", 1_434_652_673), ("ouro-2.6b", 2_667_974_657)])
def test_real_configs_have_the_published_parameter_counts(name, params):
    # L*(4d^2 + 3df + 4d) + 2Vd + d + (d + 1): the sizes of the released safetensors files
    model_cls, _, _ = mrc.MODELS[name]
    with torch.device("meta"):
        model = model_cls(mrc.model_config(name))
    assert sum(p.numel() for p in model.parameters()) == params


def test_huginn_config_has_the_published_shapes():
    with torch.device("meta"):
        model = mrc.HuginnForCausalLM(mrc.model_config("huginn-3.5b"))
    kv = model.kv_layout()
    assert (kv.num_sites, kv.kv_heads, kv.head_dim, kv.loop_steps) == (132, 55, 96, 32)


# huginn-3.5b slow: the ouro-1.4b case checks the same writer and strict load,
# test_huginn_config_has_the_published_shapes Huginn's shapes
@pytest.mark.parametrize("name", ["ouro-1.4b", pytest.param("huginn-3.5b", marks=pytest.mark.slow)])
def test_scaled_down_checkpoint_loads_strictly(tmp_path, name):
    out = mrc.write_checkpoint(name, tmp_path / name, scale_down=11)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model, tokenizer = load_model(
        out, "bfloat16", torch.device("cpu"), loop_steps=None
    )  # strict: any tensor mismatch raises
    real = mrc.model_config(name)
    assert model.kv_layout().loop_steps == {"ouro-1.4b": 4, "huginn-3.5b": 32}[name]
    assert model.config.vocab_size == real.vocab_size and len(tokenizer) <= real.vocab_size
    weights = [p for p in model.parameters() if p.dim() >= 2]
    assert all(p.dtype == torch.bfloat16 for p in weights)
    std = torch.cat([p.float().flatten() for p in weights]).std()
    assert abs(float(std) - read_model_config(out).initializer_range) < 2e-3
    again = mrc.random_model(name, scale_down=11)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.gpu
def test_a_model_loaded_onto_the_gpu_has_the_tensors_and_outputs_of_one_moved_there(tmp_path):
    """load_model reads the weights straight onto the device: the same parameters and buffers, and the same
    logits, as loading on the CPU and moving the model."""
    out = mrc.write_checkpoint("ouro-1.4b", tmp_path / "ouro", scale_down=11)
    model, _ = load_model(out, "bfloat16", torch.device("cuda"), loop_steps=None)
    moved, _ = load_model(out, "bfloat16", torch.device("cpu"), loop_steps=None)
    moved = moved.to("cuda")
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(moved.named_parameters()), **dict(moved.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert t.device.type == "cuda" and t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    ids = torch.randint(3, 1000, (1, 32), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, moved(ids).logits)
