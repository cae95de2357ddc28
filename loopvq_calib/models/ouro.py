"""Native Ouro (``model_type: "ouro"``), as described in docs/architectures.md, registered as :data:`OURO`.

The whole stack of ``num_hidden_layers`` layers runs ``total_ut_steps`` times with shared weights; the
final norm is applied after every loop and fed forward. Weight names are the hub's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig
from transformers.utils import ModelOutput

from ..config.validate import MAX_LOOP_STEPS
from .base import LoopedPreTrainedModel, make_output
from .common import ForwardContext, RMSNorm, SwiGLU, attend
from .limits import MAX_HEADS, MAX_INTERMEDIATE, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, MAX_WINDOW
from .registry import Architecture, register_architecture
from .sites import KVLayout, KVSite


class OuroConfig(PretrainedConfig):
    """Ouro's config.json fields; defaults are the hub config class's, but every value is read from file."""

    model_type = "ouro"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        *,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = 32,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        use_sliding_window: bool = False,
        sliding_window: int | None = 4096,
        max_window_layers: int = 28,
        layer_types: list[str] | None = None,
        attention_dropout: float = 0.0,
        total_ut_steps: int = 4,
        early_exit_threshold: float | None = 1.0,
        early_exit_step: int | None = None,
        **kwargs: Any,
    ) -> None:
        if use_sliding_window:
            raise ValueError("Ouro config: use_sliding_window=true is not supported (no released Ouro uses it)")
        if rope_scaling not in (None, {}) and (rope_scaling or {}).get("rope_type", "default") != "default":
            raise ValueError(f"Ouro config: rope_scaling {rope_scaling!r} is not supported (default RoPE only)")
        if hidden_act != "silu":
            raise ValueError(f"Ouro config: hidden_act {hidden_act!r} is not supported (silu only)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.use_sliding_window = use_sliding_window
        self.sliding_window = None
        self.max_window_layers = max_window_layers
        self.layer_types = layer_types or ["full_attention"] * num_hidden_layers
        self.attention_dropout = attention_dropout
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        self.early_exit_step = early_exit_step
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("eos_token_id", 0)
        kwargs.setdefault("pad_token_id", 0)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Ouro config: num_attention_heads {num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        h, kv, hd, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, site: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        return self.o_proj(attend(ctx, site, q, k=k, v=v))


class OuroDecoderLayer(nn.Module):
    """Four norms: pre-attention, on the attention output, pre-MLP, on the MLP output."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = OuroAttention(config)
        self.mlp = SwiGLU(d, config.intermediate_size)
        self.input_layernorm = RMSNorm(d, eps)
        self.input_layernorm_2 = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm_2 = RMSNorm(d, eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, site: int) -> torch.Tensor:
        h = h + self.input_layernorm_2(self.self_attn(self.input_layernorm(h), ctx, site))
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)

    def run_loop(self, h: torch.Tensor, ctx: ForwardContext, step: int) -> torch.Tensor:
        """One loop step over every layer, then the shared final norm."""
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, step * n + i)
        return self.norm(h)


def exit_pdf(gate_logits: list[torch.Tensor]) -> torch.Tensor:
    """Per-token exit distribution over loop steps [B, S, T] (computed in fp32, sums to 1)."""
    lam = torch.cat([torch.sigmoid(g.float()) for g in gate_logits], -1)
    survive = torch.cumprod(torch.cat([torch.ones_like(lam[..., :1]), 1 - lam[..., :-1]], -1), -1)
    pdf = lam * survive
    return torch.cat([pdf[..., :-1], survive[..., -1:]], -1)


class OuroForCausalLM(LoopedPreTrainedModel, GenerationMixin):
    """Ouro with the hub's early-exit readout. Logits stay in the model dtype, as in the reference."""

    config_class = OuroConfig
    base_model_prefix = "model"
    _no_split_modules = ["OuroDecoderLayer"]

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding."""
        return self.model.embed_tokens

    def kv_layout(self, num_steps: int | None = None) -> KVLayout:
        """KV sites: slot ``step * num_hidden_layers + layer``, all looped."""
        c = self.config
        steps = num_steps or c.total_ut_steps
        sites = tuple(
            KVSite(site=t * c.num_hidden_layers + l, step=t, layer=l, looped=True, stage="loop")
            for t in range(steps)
            for l in range(c.num_hidden_layers)
        )
        return KVLayout(c.model_type, sites, steps, c.num_key_value_heads, c.head_dim, "half", c.rope_theta)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        exit_at_step: int | None = None,
        early_exit_threshold: float | None = None,
        logits_to_keep: int = 0,
        output_loop_hidden_states: bool = False,
        **kwargs: Any,
    ) -> ModelOutput:
        """``use_cache`` creates a :class:`LoopKVCache` unless one is passed as ``cache`` / ``past_key_values``."""
        steps = self.config.total_ut_steps
        cache, ctx = self._forward_context(
            input_ids, attention_mask, position_ids, use_cache=use_cache, steps=steps, kwargs=kwargs
        )
        h = self.model.embed_tokens(input_ids)
        hidden, gates = [], []
        for t in range(steps):
            h = self._loop_step(self.model.run_loop, h, ctx, t)
            hidden.append(h)
            gates.append(self.model.early_exit_gate(h))
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        loss = None
        if labels is not None:
            pdf = exit_pdf(gates)[:, keep]
            logits = sum(pdf[..., t : t + 1].to(h.dtype) * self.lm_head(hidden[t][:, keep]) for t in range(steps))
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        else:
            logits = self.lm_head(self._readout(hidden, gates, exit_at_step, threshold=early_exit_threshold)[:, keep])
        return make_output(
            cache,
            loss=loss,
            logits=logits,
            loop_hidden_states=tuple(hidden) if output_loop_hidden_states else None,
            gate_logits=tuple(gates) if output_loop_hidden_states else None,
        )

    def _readout(
        self,
        hidden: list[torch.Tensor],
        gates: list[torch.Tensor],
        exit_at_step: int | None,
        *,
        threshold: float | None,
    ) -> torch.Tensor:
        """The reference readout: a fixed exit step, else the first step whose exit CDF reaches the threshold."""
        steps = len(hidden)
        exit_at_step = exit_at_step if exit_at_step is not None else self.config.early_exit_step
        if exit_at_step is not None:
            if not 0 <= exit_at_step < steps:
                raise ValueError(f"exit_at_step {exit_at_step} is outside [0, {steps})")
            return hidden[exit_at_step]
        threshold = threshold if threshold is not None else self.config.early_exit_threshold
        if threshold is None or threshold >= 1.0:
            return hidden[-1]  # a CDF reaches 1.0 only at the last step (fp32: no early rounding to 1.0)
        cdf = exit_pdf(gates).cumsum(-1)
        reached = cdf >= threshold
        reached[..., -1] = True
        step = reached.float().argmax(-1)  # first step reaching the threshold, [B, S]
        stacked = torch.stack(hidden, 0)  # [T, B, S, d]
        return stacked.gather(0, step[None, ..., None].expand(1, *stacked.shape[1:]))[0]


OURO = register_architecture(
    Architecture(
        config_class=OuroConfig,
        model_class=OuroForCausalLM,
        loop_field="total_ut_steps",
        looped_layers_field="num_hidden_layers",
        window_field="max_position_embeddings",
        rope_base_field="rope_theta",
        size_caps={
            "num_hidden_layers": (1, MAX_LAYERS),
            "total_ut_steps": (1, MAX_LOOP_STEPS),
            "num_attention_heads": (1, MAX_HEADS),
            "num_key_value_heads": (1, MAX_HEADS),
            "hidden_size": (1, MAX_WIDTH),
            "head_dim": (1, MAX_WIDTH),
            "intermediate_size": (1, MAX_INTERMEDIATE),
            "vocab_size": (1, MAX_VOCAB),
            "max_position_embeddings": (1, MAX_WINDOW),
        },
    )
)
