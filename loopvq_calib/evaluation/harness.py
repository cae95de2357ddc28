"""lm-evaluation-harness (the optional ``eval`` extra) meets our models here, and only here: :class:`ServedLM`
answers lm-eval's requests by decoding greedily through a served cache, :func:`task_manager` finds the tasks and
:func:`run_tasks` scores entries on them.

:class:`ServedLM` is built with one cache per batch from ``make_cache`` (a
:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` for a bundle or a baseline, ``None`` for the model's
own full-precision :class:`~loopvq_calib.models.cache.LoopKVCache`):

- ``generate_until``: greedy decoding, prompts left-padded into batches of ``batch_size``; the prompt is
  prefilled (attended in full precision, then its old pages encoded) and each new token is decoded from
  the cache, as a server does; generation stops at the request's ``until`` strings or ``max_gen_toks``.
- ``loglikelihood``: the context is prefilled into the cache, then the continuation is scored in one
  forward that reads the context from the cache (encoded pages included).

Its base class is lm-eval's ``LM`` when lm-eval is installed, else ``object``: this module, and the evaluation
that imports it, load without the extra, and ServedLM still decodes (passkey retrieval calls
:meth:`ServedLM.greedy`). lm-eval's evaluator and task index (about 0.4 s to import) are imported by the
functions that call them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models.cache import LoopKVCache
from .options import ServedOptions

try:
    from lm_eval.api.model import LM
except ImportError:  # without the eval extra: the tasks are refused before any work (lm_eval_available)
    LM = object  # type: ignore[misc,assignment]

TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the shipped local lm-eval tasks
DEFAULT_MAX_GEN_TOKS = 256


def lm_eval_available() -> bool:
    """Whether lm-evaluation-harness can be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


class ServedLM(LM):
    """An lm-eval ``LM`` over a loaded looped model and a cache factory (``None``: full precision)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        make_cache: Callable[[], Any] | None,
        *,
        batch_size: int = 1,
        max_length: int | None = None,
        seed: int = 0,
        forward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.make_cache = model, tokenizer, make_cache
        self.batch_size, self.seed = batch_size, seed
        self.max_length = max_length or model.window
        self.forward_kwargs = forward_kwargs or {}
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self._device = next(model.parameters()).device

    # -- helpers -------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _cache(self) -> Any:
        return self.make_cache() if self.make_cache is not None else LoopKVCache()

    def _forward(self, ids: torch.Tensor, cache: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(ids, attention_mask=mask, cache=cache, use_cache=True, **self.forward_kwargs).logits

    # -- lm-eval requests ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_until(self, requests: list[Any]) -> list[str]:
        """lm-eval's generation requests: greedy continuations, batched, cut at each request's ``until``."""
        out: list[str] = []
        args = [r.args for r in requests]
        for start in range(0, len(args), self.batch_size):
            batch = args[start : start + self.batch_size]
            kwargs = batch[0][1] or {}
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            out += self.greedy([c for c, _ in batch], _until(kwargs), max_new)
        return out

    @torch.no_grad()
    def greedy(self, contexts: list[str], until: list[str], max_new: int) -> list[str]:
        """Greedy continuations of ``contexts`` (one left-padded batch, one cache), cut at ``until``."""
        torch.manual_seed(self.seed)  # Huginn's random initial state: the same for every entry
        rows = [self._encode(c)[-(self.max_length - max_new) :] or [self.eos_id] for c in contexts]
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
        """lm-eval's scoring requests: (log-probability of the continuation, whether greedy decoding gives it)."""
        out = []
        for req in requests:
            context, continuation = req.args
            whole = self._encode(context + continuation)
            ctx = self._encode(context)
            n_ctx = len(ctx) if whole[: len(ctx)] == ctx else len(self._encode(context.rstrip()))
            ctx_ids, cont_ids = ([self.eos_id] + whole[:n_ctx]), whole[n_ctx:]
            keep = self.max_length - len(cont_ids)
            ctx_ids = ctx_ids[-keep:]
            torch.manual_seed(self.seed)
            cache = self._cache()
            first = self._forward(torch.tensor([ctx_ids], device=self._device), cache)[:, -1:]
            rest = (
                self._forward(torch.tensor([cont_ids[:-1]], device=self._device), cache)
                if len(cont_ids) > 1
                else first[:, :0]
            )
            logp = torch.log_softmax(torch.cat([first, rest], 1)[0].float(), -1)
            target = torch.tensor(cont_ids, device=self._device)
            out.append((logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """Not served: perplexity comes from the evaluation on held-out text instead."""
        raise NotImplementedError(
            "perplexity tasks are not served through the cache; loopvq-eval reports "
            "perplexity and the evaluation KL on held-out text (--data) instead"
        )


# -- lm-eval tasks ----------------------------------------------------------------------------------------
def task_manager(include_path: list[str], tasks: list[str] | None = None) -> Any:
    """lm-eval's task registry with the shipped local tasks (:data:`TASKS_DIR`) and ``include_path``; lm-eval's
    own tasks (indexing them takes ~20 s) only when ``tasks`` needs one (or ``tasks`` is None)."""
    local = _manager((str(TASKS_DIR), *include_path), False)
    if tasks is not None and all(t in local.all_tasks for t in tasks):
        return local
    return _manager((str(TASKS_DIR), *include_path), True)


@functools.lru_cache(maxsize=4)
def _manager(paths: tuple[str, ...], include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths), include_defaults=include_defaults)


def run_tasks(model: torch.nn.Module, tokenizer: Any, entries: list[Any], *, options: ServedOptions) -> dict[str, Any]:
    """Every entry (:class:`~loopvq_calib.evaluation.served.Entry`: ``name``, ``make_cache()``) on
    ``options.tasks`` through lm-eval; ``{"tasks", "limit", "scores": {entry: {task: {metric: v}}},
    "samples": {task: n}}``."""
    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    manager = task_manager(options.include_path, options.tasks)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    samples: dict[str, int] = {}
    seed = options.seed
    for e in entries:
        lm = ServedLM(model, tokenizer, e.make_cache(), batch_size=options.batch_size, seed=seed)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(options.tasks),
            limit=options.limit,
            task_manager=manager,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
            confirm_run_unsafe_code=options.confirm_run_unsafe_code,
        )
        scores[e.name] = {task: _metrics(res) for task, res in out["results"].items()}
        samples = {
            task: int(n.get("effective", n.get("original", 0))) if isinstance(n, dict) else int(n)
            for task, n in (out.get("n-samples") or {}).items()
        }
    return {"tasks": list(options.tasks), "limit": options.limit, "scores": scores, "samples": samples}


def _metrics(result: dict[str, Any]) -> dict[str, float]:
    """``{"exact_match,first_word": 0.5, ...}``: the "metric,filter" entries, without stderr."""
    return {k: float(v) for k, v in result.items() if isinstance(v, (int, float)) and "," in k and "_stderr" not in k}


def _until(kwargs: dict[str, Any]) -> list[str]:
    until = kwargs.get("until") or []
    return [until] if isinstance(until, str) else list(until)


def _hit(text: str, until: list[str]) -> bool:
    return any(u in text for u in until)


def _cut(text: str, until: list[str]) -> str:
    for u in until:
        if u in text:
            text = text[: text.index(u)]
    return text
