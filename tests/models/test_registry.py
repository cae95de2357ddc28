"""The architecture registry: one module declares an architecture and the toolkit takes it. A toy looped
architecture declared and registered in this file alone (its own field names for the loop count, the window and
the RoPE base) loads through the toolkit's loader, answers the hooks, is calibrated into a bundle and decodes
through the served cache; it is unregistered afterwards. Also the registry's own rules."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_tiny_huginn, make_tiny_ouro, save_with_tokenizer
from support.builders import tiny_config
from torch import nn
from transformers import GenerationMixin, PretrainedConfig
from transformers.utils import ModelOutput

from loopvq_calib import QuantizedLoopKVCache, calibrate, load_bundle
from loopvq_calib.models import (
    Architecture,
    KVLayout,
    KVSite,
    LoopedPreTrainedModel,
    OuroConfig,
    OuroForCausalLM,
    model_types,
    register_architecture,
    unregister_architecture,
)
from loopvq_calib.models.base import CACHE_FIELD, make_output
from loopvq_calib.models.common import ForwardContext, RMSNorm, SwiGLU, attend
from loopvq_calib.models.loading import ModelLoadError, check_model_folder, load_model, model_window
from loopvq_calib.models.registry import architecture_of, find_architecture

KEY = "model.name_or_path"


class ToyLoopConfig(PretrainedConfig):
    """A toy looped model: ``layers_per_loop`` layers run ``loops`` times; the window is ``context``."""

    model_type = "toy_loop"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 64,
        num_attention_heads: int = 4,
        *,
        layers_per_loop: int = 2,
        loops: int = 4,
        context: int = 256,
        rope_base: float = 10000.0,
        **kwargs: Any,
    ) -> None:
        self.vocab_size, self.hidden_size, self.num_attention_heads = vocab_size, hidden_size, num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.layers_per_loop, self.loops, self.context, self.rope_base = layers_per_loop, loops, context, rope_base
        super().__init__(**kwargs)


class ToyLayer(nn.Module):
    """Pre-norm attention and SwiGLU, both residual."""

    def __init__(self, config: ToyLoopConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp = SwiGLU(d, 2 * d)
        self.norm_1, self.norm_2 = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, site: int) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.qkv(self.norm_1(h)).chunk(3, -1))
        h = h + self.out(attend(ctx, site, q, k=k, v=v))
        return h + self.mlp(self.norm_2(h))


class ToyLoopForCausalLM(LoopedPreTrainedModel, GenerationMixin):
    """KV site ``loop * layers_per_loop + layer``, all looped."""

    config_class = ToyLoopConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyLoopConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ToyLayer(config) for _ in range(config.layers_per_loop))
        self.norm = RMSNorm(config.hidden_size, 1e-6)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def kv_layout(self, num_steps: int | None = None) -> KVLayout:
        c, steps = self.config, num_steps or self.loop_steps
        n = c.layers_per_loop
        sites = tuple(KVSite(t * n + i, t, i, True, "loop") for t in range(steps) for i in range(n))
        return KVLayout(c.model_type, sites, steps, c.num_attention_heads, c.head_dim, "half", c.rope_base)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> ModelOutput:
        steps = self.loop_steps
        cache, ctx = self._forward_context(
            input_ids, attention_mask, position_ids, use_cache=use_cache, steps=steps, kwargs=kwargs
        )
        h = self.embed(input_ids)
        for t in range(steps):
            for i, layer in enumerate(self.layers):
                h = layer(h, ctx, t * len(self.layers) + i)
        h = self.norm(h[:, -logits_to_keep:] if logits_to_keep else h)
        return make_output(cache, logits=self.lm_head(h))


TOY = Architecture(
    config_class=ToyLoopConfig,
    model_class=ToyLoopForCausalLM,
    loop_field="loops",
    looped_layers_field="layers_per_loop",
    window_field="context",
    rope_base_field="rope_base",
    size_caps={"loops": (1, 64), "layers_per_loop": (1, 8), "context": (1, 4096)},
)


@pytest.fixture
def toy() -> Iterator[Architecture]:
    """The toy architecture, registered for the test."""
    yield register_architecture(TOY)
    unregister_architecture(TOY.model_type)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random toy model saved in the hub layout, with the reference model's tokenizer."""
    torch.manual_seed(0)
    model = ToyLoopForCausalLM(ToyLoopConfig()).eval()
    with torch.no_grad():  # weights large enough that the loops and the keys matter
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("toy-loop"))


def test_the_toy_loads_through_the_toolkit_and_answers_the_hooks(toy, toy_dir):
    assert model_types()[-1] == "toy_loop"
    model, _ = load_model(toy_dir, "float32", torch.device("cpu"), loop_steps=2)
    assert type(model) is ToyLoopForCausalLM and model.architecture is TOY
    assert (model.config.loops, model.loop_steps, model.window) == (2, 2, 256)
    assert model_window(model.config) == (256, "context")
    kv = model.kv_layout()
    assert [(s.site, s.step, s.layer) for s in kv.sites] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert model.loop_details() == {}


def test_the_toy_config_json_is_checked_against_its_declared_caps(toy, toy_dir, tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    for f in toy_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "loops": 65}))
    with pytest.raises(ModelLoadError) as err:
        check_model_folder(folder, KEY)
    assert str(err.value) == (
        f"{KEY}: {folder}/config.json: field loops (loop steps) is 65, more than this toolkit "
        'takes (64: docs/reliability.md, "Bounds")'
    )
    (folder / "config.json").write_text(json.dumps({**raw, "loops": 64, "layers_per_loop": 8, "context": 0}))
    with pytest.raises(ModelLoadError, match=r"field context \(the model's window\) must be a positive integer"):
        check_model_folder(folder, KEY)


def test_the_toy_calibrates_into_a_bundle_that_the_served_cache_decodes(toy, toy_dir, calib_corpus, tmp_path):
    result = calibrate(tiny_config(toy_dir, calib_corpus, tmp_path / "run"))
    bundle = load_bundle(result.bundle, model=toy_dir)
    model, _ = load_model(toy_dir, "float32", torch.device("cpu"))
    assert bundle.meta["model"]["model_type"] == "toy_loop"
    assert bundle.quantizer.kv == model.kv_layout()
    prompt = torch.randint(0, 4096, (1, 37), generator=torch.Generator().manual_seed(3))
    runs = {}
    for store in ("indices", "fake"):  # decoding the codes == attending the decoded keys and values in place
        cache = QuantizedLoopKVCache(bundle.quantizer, sink_tokens=8, recent_window=16, page_size=8, store=store)
        runs[store] = greedy_logits(model, prompt, cache, new_tokens=6)
    plain = greedy_logits(model, prompt, None, new_tokens=6)
    torch.testing.assert_close(runs["indices"], runs["fake"], rtol=0, atol=1e-5)
    torch.testing.assert_close(runs["indices"][0], plain[0], rtol=0, atol=0)  # prefill attends full precision
    assert (runs["indices"] - plain).abs().max() > 1e-3  # the encoded pages change what follows


def greedy_logits(model: nn.Module, prompt: torch.Tensor, cache: Any, *, new_tokens: int) -> torch.Tensor:
    """The last position's logits of the prefill and of each greedily decoded token, [new_tokens + 1, vocab];
    ``cache`` None: the model's own full-precision cache."""
    out = model(prompt, cache=cache, use_cache=True)
    cache = cache if cache is not None else getattr(out, CACHE_FIELD)
    logits = [out.logits[0, -1]]
    for _ in range(new_tokens):
        out = model(logits[-1].argmax()[None, None], cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def test_after_unregistering_the_toolkit_refuses_the_toy(toy, tmp_path):
    folder = save_with_tokenizer(ToyLoopForCausalLM(ToyLoopConfig()), tmp_path / "toy")
    assert check_model_folder(folder, KEY).model_type == "toy_loop"
    unregister_architecture("toy_loop")
    assert find_architecture("toy_loop") is None and model_types() == ("ouro", "huginn_raven")
    with pytest.raises(ModelLoadError) as err:
        check_model_folder(folder, KEY)
    assert str(err.value) == (
        f"{KEY}: model_type 'toy_loop' in {folder}/config.json is not a supported looped model; "
        "supported: ouro, huginn_raven"
    )


@pytest.mark.parametrize(
    "make, fields",
    [
        (make_tiny_ouro, ("total_ut_steps", "max_position_embeddings", "num_hidden_layers")),
        (make_tiny_huginn, ("mean_recurrence", "block_size", "n_layers_in_recurrent_block")),
    ],
)
def test_the_shipped_architectures_hooks_read_and_set_their_own_fields(make, fields):
    model = make()
    loop, window, layers = (getattr(model.config, f) for f in fields)
    assert (model.loop_steps, model.window, model.architecture.looped_layers(model.config)) == (loop, window, layers)
    model.set_loop_steps(loop + 4)
    assert getattr(model.config, fields[0]) == model.kv_layout().loop_steps == loop + 4


def test_huginn_details_say_how_its_initial_state_is_drawn():
    assert make_tiny_huginn(state_init="like-init", mean_recurrence=3).loop_details() == {
        "recurrences": 3,
        "initial_state": f"like-init: truncated normal, std {math.sqrt(2 / (5 * 64))}, times {math.sqrt(64)}, torch "
        "seed reset per request",
    }


def test_the_registry_refuses_a_second_architecture_for_a_type_and_mismatched_classes():
    other = dataclasses.replace(TOY, config_class=OuroConfig)
    with pytest.raises(ValueError, match="ToyLoopForCausalLM.config_class is not OuroConfig"):
        register_architecture(other)
    again = dataclasses.replace(TOY, config_class=OuroConfig, model_class=OuroForCausalLM)
    with pytest.raises(ValueError, match="model_type 'ouro' is already registered \\(OuroForCausalLM\\)"):
        register_architecture(again)
    assert find_architecture(["ouro"]) is None  # any JSON value, even one that cannot be a key
    with pytest.raises(
        ValueError, match="model_type 'llama' is not a registered looped architecture; registered: ouro, huginn_raven"
    ):
        architecture_of({"model_type": "llama"})
