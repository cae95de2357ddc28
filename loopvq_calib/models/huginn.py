"""Native Huginn-0125 (``model_type: "huginn_raven"``), as described in docs/architectures.md, registered as
:data:`HUGINN`.

Prelude blocks -> recurrent core iterated ``num_steps`` times with a linear adapter over
[state, embedded input] -> coda blocks. Sandwich blocks normalise the residual sum. Weight names are
the hub's (``transformer.prelude.0.attn.Wqkv.weight`` ...). KV site ids: prelude i -> i, core (t, j) ->
P + C*t + j, coda k -> P + C*r + k.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig
from transformers.utils import ModelOutput

from ..config.validate import MAX_LOOP_STEPS
from .base import LoopedPreTrainedModel, make_output
from .common import ForwardContext, RMSNorm, attend
from .limits import MAX_HEADS, MAX_INTERMEDIATE, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, MAX_WINDOW
from .registry import Architecture, register_architecture
from .sites import KVLayout, KVSite


class HuginnConfig(PretrainedConfig):
    """Huginn's config.json fields (``n_embd``, ``n_heads``, ...) with transformers' standard aliases."""

    model_type = "huginn_raven"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}

    def __init__(
        self,
        n_embd: int = 5280,
        n_heads: int = 55,
        n_layers: int = 8,
        *,
        n_layers_in_prelude: int = 2,
        n_layers_in_recurrent_block: int = 4,
        n_layers_in_coda: int = 2,
        intermediate_size: int = 17920,
        vocab_size: int = 65536,
        padded_vocab_size: int | None = None,
        block_size: int = 4096,
        rope_base: float = 50000.0,
        norm_eps: float = 1e-6,
        qk_bias: bool = True,
        bias: bool = False,
        tie_embeddings: bool = True,
        injection_type: str = "linear",
        state_init: str = "like-init",
        init_values: dict | None = None,
        mean_recurrence: int = 32,
        mean_backprop_depth: int = 8,
        **kwargs: Any,
    ) -> None:
        if injection_type != "linear":
            raise ValueError(f"Huginn config: injection_type {injection_type!r} is not supported (linear only)")
        if bias:
            raise ValueError("Huginn config: bias=true is not supported (the released model has no linear biases)")
        if state_init not in ("like-init", "zero"):
            raise ValueError(f"Huginn config: state_init {state_init!r}; expected 'like-init' or 'zero'")
        if n_layers != n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda:
            raise ValueError(
                f"Huginn config: n_layers {n_layers} != prelude {n_layers_in_prelude} + core "
                f"{n_layers_in_recurrent_block} + coda {n_layers_in_coda}"
            )
        self.n_embd = n_embd
        self.n_heads = n_heads
        self.num_key_value_heads = n_heads  # forced MHA, as the hub config class does
        self.head_dim = n_embd // n_heads
        self.n_layers = n_layers
        self.n_layers_in_prelude = n_layers_in_prelude
        self.n_layers_in_recurrent_block = n_layers_in_recurrent_block
        self.n_layers_in_coda = n_layers_in_coda
        self.intermediate_size = intermediate_size
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size or vocab_size
        self.block_size = block_size
        self.rope_base = rope_base
        self.norm_eps = norm_eps
        self.qk_bias = qk_bias
        self.bias = bias
        self.tie_embeddings = tie_embeddings
        self.injection_type = injection_type
        self.state_init = state_init
        std = math.sqrt(2 / (5 * n_embd))
        self.init_values = init_values or {
            "std": std,
            "out_proj": std
            / math.sqrt(2 * (n_layers_in_prelude + n_layers_in_coda + n_layers_in_recurrent_block * mean_recurrence)),
            "embedding": std,
            "embed_scale": math.sqrt(n_embd),
        }
        self.mean_recurrence = mean_recurrence
        self.mean_backprop_depth = mean_backprop_depth
        self.initializer_range = self.init_values["std"]
        kwargs.pop("tie_word_embeddings", None)
        kwargs.setdefault("bos_token_id", 65504)
        kwargs.setdefault("eos_token_id", 65505)
        kwargs.setdefault("pad_token_id", 65509)
        super().__init__(tie_word_embeddings=tie_embeddings, **kwargs)


class HuginnAttention(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        d, h = config.n_embd, config.n_heads
        self.heads, self.head_dim = h, config.head_dim
        self.Wqkv = nn.Linear(d, 3 * d, bias=False)
        self.qk_bias = nn.Parameter(torch.zeros(2, 1, h, self.head_dim)) if config.qk_bias else None
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, site: int) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.Wqkv(x).split(d, dim=-1))
        if self.qk_bias is not None:
            q = (q + self.qk_bias[0]).to(q.dtype)
            k = (k + self.qk_bias[1]).to(q.dtype)  # the pre-RoPE key includes the bias
        return self.proj(attend(ctx, site, q, k=k, v=v))


class HuginnMLP(nn.Module):
    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(a) * b)


class SandwichBlock(nn.Module):
    """x = norm_2(x + attn(norm_1(x))); x = norm_4(x + mlp(norm_3(x)))."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        d, eps = config.n_embd, config.norm_eps
        self.norm_1, self.norm_2, self.norm_3, self.norm_4 = (RMSNorm(d, eps) for _ in range(4))
        self.attn = HuginnAttention(config)
        self.mlp = HuginnMLP(config)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, site: int) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), ctx, site))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


def sequence_seed(ids: torch.Tensor, seed: int = 0) -> int:
    """Seed of one sequence's initial state: the first 63 bits of sha256(``seed`` as 8 bytes, then the
    token ids [S] as little-endian int64), so it depends on the tokens only, not on batch or device."""
    data = seed.to_bytes(8, "little", signed=True) + ids.detach().to("cpu", torch.int64).numpy().astype("<i8").tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") & ((1 << 63) - 1)


class HuginnForCausalLM(LoopedPreTrainedModel, GenerationMixin):
    """Huginn with the number of recurrences as an argument; fp32 logits as in the reference."""

    config_class = HuginnConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["SandwichBlock"]
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    optional_checkpoint_keys = ("freqs_cis",)
    _state_seed: int | None = None  # set inside seeded_initial_state
    _state_memo: tuple | None = None  # (key, state) of the last seeded draw: the next forward of those sequences

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__(config)
        d = config.n_embd
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.padded_vocab_size, d),
                "prelude": nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_prelude)),
                "adapter": nn.Linear(2 * d, d, bias=False),
                "core_block": nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_recurrent_block)),
                "coda": nn.ModuleList(SandwichBlock(config) for _ in range(config.n_layers_in_coda)),
                "ln_f": RMSNorm(d, config.norm_eps),
            }
        )
        self.lm_head = nn.Linear(d, config.padded_vocab_size, bias=False)
        # the hub checkpoint stores its RoPE table; we accept it, but compute RoPE from rope_base
        self.register_buffer("freqs_cis", self._rope_table(config), persistent=True)
        self.post_init()

    @staticmethod
    def _rope_table(config: HuginnConfig) -> torch.Tensor:
        hd = config.head_dim
        inv = 1.0 / (config.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(config.block_size, dtype=torch.float32)[:, None] * inv
        return torch.stack([ang.cos(), ang.sin()], -1)[None, :, None]  # [1, block, 1, hd/2, 2]

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding."""
        return self.transformer.wte

    def kv_layout(self, num_steps: int | None = None) -> KVLayout:
        """KV sites: prelude i -> i, core (t, j) -> P + C*t + j (looped), coda k -> P + C*r + k."""
        c = self.config
        r = num_steps or c.mean_recurrence
        p, core = c.n_layers_in_prelude, c.n_layers_in_recurrent_block
        sites = [KVSite(i, 0, i, False, "prelude") for i in range(p)]
        sites += [KVSite(p + core * t + j, t, j, True, "loop") for t in range(r) for j in range(core)]
        sites += [KVSite(p + core * r + k, 0, k, False, "coda") for k in range(c.n_layers_in_coda)]
        return KVLayout(c.model_type, tuple(sites), r, c.n_heads, c.head_dim, "interleaved", c.rope_base)

    def initial_state(
        self, like: torch.Tensor, init_scale: float = 1.0, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Random like-init state (truncated normal, +-3 std, times the embedding scale), or zeros.

        Inside :meth:`seeded_initial_state` (and when ``input_ids`` [B, S] are given) each row is drawn
        from its own CPU generator seeded by :func:`sequence_seed`, so every forward of one sequence
        starts from the same state; otherwise from the global generator, as the hub model does."""
        if self.config.state_init == "zero" or init_scale == 0:
            return torch.zeros_like(like)
        std = self.config.init_values["std"] * init_scale
        scale = self.config.init_values["embed_scale"]
        if self._state_seed is None or input_ids is None:
            s = torch.empty_like(like)
            nn.init.trunc_normal_(s, mean=0.0, std=std, a=-3 * std, b=3 * std)
            return s * scale
        seeds = tuple(sequence_seed(row, self._state_seed) for row in input_ids.cpu())  # one copy, not one per row
        key = (seeds, tuple(like.shape), like.device, like.dtype, std)
        if self._state_memo is not None and self._state_memo[0] == key:  # the other forward of the same sequences
            return self._state_memo[1]
        rows = []
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            s = torch.empty(like.shape[1:], dtype=torch.float32)
            rows.append(nn.init.trunc_normal_(s, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen) * scale)
        state = torch.stack(rows).to(like.device, like.dtype)
        self._state_memo = (key, state)
        return state

    @contextmanager
    def seeded_initial_state(self, seed: int = 0) -> Iterator[None]:
        """Within the block every forward draws each sequence's like-init state reproducibly, from
        ``seed`` and the sequence's tokens: the teacher and the quantized forward of a sequence (in
        capture, fine-tuning and evaluation) share one state. Nested blocks keep the outermost seed."""
        previous = self._state_seed
        self._state_seed = seed if previous is None else previous
        try:
            yield
        finally:
            self._state_seed = previous

    def loop_details(self) -> dict[str, Any]:
        """The recurrence count and how the initial state is drawn (evaluation reports record both)."""
        c = self.config
        state = (
            "zero"
            if c.state_init == "zero"
            else f"{c.state_init}: truncated normal, std {c.init_values['std']}, times "
            f"{c.init_values['embed_scale']}, torch seed reset per request"
        )
        return {"recurrences": c.mean_recurrence, "initial_state": state}

    def _core_step(self, s: torch.Tensor, e: torch.Tensor, ctx: ForwardContext, t: int) -> torch.Tensor:
        """Recurrence ``t``: the adapter over [state, embedded input], then the core blocks (a checkpointed step:
        called positionally)."""
        tf, c = self.transformer, self.config
        s = tf.adapter(torch.cat([s, e], dim=-1))
        base = c.n_layers_in_prelude + c.n_layers_in_recurrent_block * t
        for j, block in enumerate(tf.core_block):
            s = block(s, ctx, base + j)
        return s

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        num_steps: int | None = None,
        input_states: torch.Tensor | None = None,
        init_scale: float = 1.0,
        logits_to_keep: int = 0,
        output_loop_hidden_states: bool = False,
        **kwargs: Any,
    ) -> ModelOutput:
        """``num_steps`` recurrences (default ``mean_recurrence``); ``input_states`` fixes the initial state."""
        c, tf = self.config, self.transformer
        r = num_steps or c.mean_recurrence
        cache, ctx = self._forward_context(
            input_ids, attention_mask, position_ids, use_cache=use_cache, steps=r, kwargs=kwargs
        )
        e = tf.wte(input_ids) * torch.tensor(c.init_values["embed_scale"], dtype=tf.wte.weight.dtype)
        for i, block in enumerate(tf.prelude):
            e = block(e, ctx, i)
        state = input_states if input_states is not None else self.initial_state(e, init_scale, input_ids)
        hidden = []
        for t in range(r):
            state = self._loop_step(self._core_step, state, e, ctx, t)
            hidden.append(state)
        x = tf.ln_f(state)
        coda_base = c.n_layers_in_prelude + c.n_layers_in_recurrent_block * r
        for k, block in enumerate(tf.coda):
            x = block(x, ctx, coda_base + k)
        x = tf.ln_f(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return make_output(
            cache, loss=loss, logits=logits, loop_hidden_states=tuple(hidden) if output_loop_hidden_states else None
        )


HUGINN = register_architecture(
    Architecture(
        config_class=HuginnConfig,
        model_class=HuginnForCausalLM,
        loop_field="mean_recurrence",
        looped_layers_field="n_layers_in_recurrent_block",
        window_field="block_size",
        rope_base_field="rope_base",
        size_caps={
            "n_layers": (1, MAX_LAYERS),
            "n_layers_in_prelude": (0, MAX_LAYERS),
            "n_layers_in_recurrent_block": (1, MAX_LAYERS),
            "n_layers_in_coda": (0, MAX_LAYERS),
            "mean_recurrence": (1, MAX_LOOP_STEPS),
            "n_heads": (1, MAX_HEADS),
            "n_embd": (1, MAX_WIDTH),
            "intermediate_size": (1, MAX_INTERMEDIATE),
            "vocab_size": (1, MAX_VOCAB),
            "padded_vocab_size": (1, MAX_VOCAB),
            "block_size": (1, MAX_WINDOW),
        },
    )
)
