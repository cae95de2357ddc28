"""lm-evaluation-harness model class: our native looped models, decoding greedily through a served cache.

:class:`ServedLM` answers lm-eval's requests with one cache per batch built by ``make_cache`` (a
:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` for a bundle or a baseline, ``None`` for the model's
own full-precision :class:`~loopvq_calib.models.cache.LoopKVCache`):

- ``generate_until``: greedy decoding, prompts left-padded into batches of ``batch_size``; the prompt is
  prefilled (attended in full precision, then its old pages encoded) and each new token is decoded from
  the cache, as a server does; generation stops at the request's ``until`` strings or ``max_gen_toks``.
- ``loglikelihood``: the context is prefilled into the cache, then the continuation is scored in one
  forward that reads the context from the cache (encoded pages included).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from lm_eval.api.model import LM

DEFAULT_MAX_GEN_TOKS = 256


class ServedLM(LM):
    """An lm-eval ``LM`` over a loaded looped model and a cache factory (``None``: full precision)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, make_cache: Callable[[], Any] | None,
                 *, batch_size: int = 1, max_length: int | None = None, seed: int = 0,
                 forward_kwargs: dict[str, Any] | None = None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.make_cache = model, tokenizer, make_cache
        self.batch_size, self.seed = batch_size, seed
        cfg = model.config
        self.max_length = max_length or getattr(cfg, "max_position_embeddings", None) or cfg.block_size
        self.forward_kwargs = forward_kwargs or {}
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self._device = next(model.parameters()).device

    # -- helpers -------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _cache(self) -> Any:
        from ..models.cache import LoopKVCache

        return self.make_cache() if self.make_cache is not None else LoopKVCache()

    def _forward(self, ids: torch.Tensor, cache: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(ids, attention_mask=mask, cache=cache, use_cache=True, **self.forward_kwargs).logits

    # -- lm-eval requests ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_until(self, requests: list[Any]) -> list[str]:
        out: list[str] = []
        args = [r.args for r in requests]
        for start in range(0, len(args), self.batch_size):
            batch = args[start:start + self.batch_size]
            kwargs = batch[0][1] or {}
            out += self.greedy([c for c, _ in batch], _until(kwargs), int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)))
        return out

    @torch.no_grad()
    def greedy(self, contexts: list[str], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of ``contexts`` (one left-padded batch, one cache), cut at ``until``."""
        torch.manual_seed(self.seed)  # Huginn's random initial state: the same for every entry
        rows = [self._encode(c)[-(self.max_length - max_new):] or [self.eos_id] for c in contexts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.eos_id] * (width - len(r)) + r for r in rows], device=self._device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self._device)
        padded = bool((mask == 0).any())
        cache = self._cache()
        logits = self._forward(ids, cache, mask if padded else None)[:, -1]
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(max_new):
            nxt = logits.argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    new[i].append(t)
                    done[i] = t == self.eos_id or _hit(self.tokenizer.decode(new[i]), until)
            if all(done):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = self._forward(nxt[:, None], cache, mask if padded else None)[:, -1]
        return [_cut(self.tokenizer.decode([t for t in n if t != self.eos_id]), until) for n in new]

    @torch.no_grad()
    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        out = []
        for req in requests:
            context, continuation = req.args
            whole = self._encode(context + continuation)
            ctx = self._encode(context)
            n_ctx = len(ctx) if whole[:len(ctx)] == ctx else len(self._encode(context.rstrip()))
            ctx_ids, cont_ids = ([self.eos_id] + whole[:n_ctx]), whole[n_ctx:]
            keep = self.max_length - len(cont_ids)
            ctx_ids = ctx_ids[-keep:]
            torch.manual_seed(self.seed)
            cache = self._cache()
            first = self._forward(torch.tensor([ctx_ids], device=self._device), cache)[:, -1:]
            rest = self._forward(torch.tensor([cont_ids[:-1]], device=self._device), cache) if len(cont_ids) > 1 else first[:, :0]
            logp = torch.log_softmax(torch.cat([first, rest], 1)[0].float(), -1)
            target = torch.tensor(cont_ids, device=self._device)
            out.append((logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        raise NotImplementedError("perplexity tasks are not served through the cache; loopvq-eval reports "
                                  "perplexity and the evaluation KL on held-out text (--data) instead")


def _until(kwargs: dict[str, Any]) -> list[str]:
    until = kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _hit(text: str, until: list[str]) -> bool:
    return any(u in text for u in until)


def _cut(text: str, until: list[str]) -> str:
    for u in until:
        if u in text:
            text = text[:text.index(u)]
    return text
