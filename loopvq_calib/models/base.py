"""What the native looped models share: strict hub-layout loading, generation glue, the KV hook slot, and the hooks
callers ask instead of comparing ``model_type`` (loop count, window, KV layout, initial state)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import field, make_dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.generation import utils as generation_utils
from transformers.utils import ModelOutput

from .cache import LoopKVCache
from .common import ForwardContext, RMSNorm, build_context, pick
from .registry import Architecture, architecture_of
from .sites import KVLayout


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not match the model built from its config.json."""


# transformers 5.x renamed the cache slot of model outputs from ``past_key_values`` to ``cache`` (the
# GPU image has 5.17, CI the newest): name our field the way the installed generate() reads it.
CACHE_FIELD = "cache" if "cache" in getattr(generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"

LoopCausalLMOutput = make_dataclass(
    "LoopCausalLMOutput",
    [
        ("loss", torch.Tensor | None, field(default=None)),
        ("logits", torch.Tensor | None, field(default=None)),
        (CACHE_FIELD, Any, field(default=None)),
        ("loop_hidden_states", tuple | None, field(default=None)),
        ("gate_logits", tuple | None, field(default=None)),
    ],
    bases=(ModelOutput,),
)
LoopCausalLMOutput.__doc__ = "Causal-LM output; the cache sits under ``CACHE_FIELD``."
LoopCausalLMOutput.__module__ = __name__


def make_output(cache: LoopKVCache | None, **fields: Any) -> ModelOutput:
    """Build a :data:`LoopCausalLMOutput` with the cache under the installed transformers' name."""
    return LoopCausalLMOutput(**fields, **{CACHE_FIELD: cache})


class LoopedPreTrainedModel(PreTrainedModel):
    """Base of the native looped models; its hooks answer what callers would otherwise branch on ``model_type`` for
    (the facts come from the model's registered :class:`~loopvq_calib.models.registry.Architecture`)."""

    supports_gradient_checkpointing = False
    _supports_sdpa = True
    optional_checkpoint_keys: tuple[str, ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # set only through the context managers of models/sites.py (kv_hook, query_observer, loop_checkpointing)
        self.kv_hook = None
        self.query_observer = None  # called with (site, pre-RoPE query [B,S,Hq,D], positions)
        self.loop_checkpointing = False  # activation checkpointing per loop step (training only)

    @property
    def architecture(self) -> Architecture:
        """The registered architecture of this model's ``model_type``."""
        return architecture_of(self.config)

    @property
    def loop_steps(self) -> int:
        """The loop count the forward runs by default (the architecture's loop field of the config)."""
        return getattr(self.config, self.architecture.loop_field)

    def set_loop_steps(self, steps: int) -> None:
        """Run ``steps`` loops from now on (Ouro ``total_ut_steps``, Huginn recurrences ``mean_recurrence``)."""
        setattr(self.config, self.architecture.loop_field, steps)

    @property
    def window(self) -> int:
        """The longest sequence the model takes (Ouro ``max_position_embeddings``, Huginn ``block_size``)."""
        return self.architecture.window(self.config)[0]

    def kv_layout(self, num_steps: int | None = None) -> KVLayout:
        """The KV sites at ``num_steps`` loops (default: :attr:`loop_steps`): docs/loop-sites.md."""
        raise NotImplementedError(f"{type(self).__name__} declares no kv_layout")

    def seeded_initial_state(self, seed: int = 0) -> AbstractContextManager[None]:
        """Within the block every forward of one sequence starts from the same initial state, drawn from ``seed``
        and its tokens; a model whose initial state is not random (Ouro) has nothing to seed."""
        return nullcontext()

    def loop_details(self) -> dict[str, Any]:
        """What an evaluation report records about the loop beyond its count (Huginn: recurrences and how the
        initial state is drawn); nothing by default."""
        return {}

    def _loop_step(self, step: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """One loop step, recomputed in the backward pass when ``loop_checkpointing`` is on and gradients flow."""
        if self.loop_checkpointing and torch.is_grad_enabled():
            return checkpoint(step, *args, use_reentrant=False)
        return step(*args)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # we bring our own LoopKVCache, created in forward

    def _init_weights(self, module: nn.Module) -> None:
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Load a hub-layout checkpoint; any missing, unexpected or mis-shaped tensor is an error."""
        wanted_info = kwargs.pop("output_loading_info", False)
        kwargs["ignore_mismatched_sizes"] = True  # so that mis-shaped tensors are listed below, by name
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = []
        missing = sorted(k for k in info.get("missing_keys", []) if k not in cls.optional_checkpoint_keys)
        for what, names in (
            ("missing", missing),
            ("unexpected", sorted(info.get("unexpected_keys", []))),
            ("mis-shaped", sorted(_describe_mismatch(m) for m in info.get("mismatched_keys", []))),
        ):
            if names:
                problems.append(f"{what} tensors: {', '.join(names)}")
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {args[0] if args else ''} does not match {cls.__name__} built from its "
                f"config.json; " + "; ".join(problems)
            )
        return (model, info) if wanted_info else model

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head (transformers ties and resizes embeddings through it)."""
        return self.lm_head

    def _forward_context(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        *,
        use_cache: bool | None,
        steps: int,
        kwargs: dict[str, Any],
    ) -> tuple[Any, ForwardContext]:
        """The cache (given as ``cache`` / ``past_key_values``, or a new :class:`LoopKVCache` when
        ``use_cache``) and the per-forward context (positions, mask, RoPE, hooks) shared by both models."""
        cache = pick(kwargs, "cache", "past_key_values")
        if cache is None and use_cache:
            cache = LoopKVCache()
        if cache is not None and hasattr(cache, "check_steps"):
            cache.check_steps(steps)
        kv = self.kv_layout(steps)
        b, s = input_ids.shape
        ctx = build_context(
            s,
            b,
            input_ids.device,
            rope_style=kv.rope_style,
            rope_theta=kv.rope_theta,
            cache=cache,
            attention_mask=attention_mask,
            position_ids=position_ids,
            hook=kwargs.get("kv_hook", self.kv_hook),
            query_observer=self.query_observer,
        )
        return cache, ctx

    def prepare_inputs_for_generation(
        self, input_ids: torch.Tensor, cache: Any = None, past_key_values: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """Feed only the tokens the cache has not seen; works with transformers 5.x before and after the
        ``past_key_values`` -> ``cache`` rename (declaring both lets generate() accept a user cache)."""
        cache = cache if cache is not None else past_key_values
        if cache is not None:
            input_ids = input_ids[:, cache.get_seq_length() :]
        return {
            "input_ids": input_ids,
            "cache": cache,
            "attention_mask": kwargs.get("attention_mask"),
            "use_cache": kwargs.get("use_cache", True),
        }

    def _reorder_cache(self, cache: LoopKVCache, beam_idx: torch.LongTensor) -> LoopKVCache:
        cache.reorder_cache(beam_idx)
        return cache


def _describe_mismatch(item: Any) -> str:
    """transformers reports (name, checkpoint shape, model shape) tuples, or bare names."""
    if isinstance(item, (tuple, list)) and len(item) == 3:
        name, ckpt, ours = item
        return f"{name} (checkpoint {tuple(ckpt)}, model {tuple(ours)})"
    return str(item)
