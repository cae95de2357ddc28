"""Evaluation through the served cache: lm-eval task accuracy, passkey retrieval and measured bytes per
token of the full-precision model, each bundle and each baseline, side by side (``loopvq-eval --tasks``).

An *entry* is one way of serving the model: ``full-precision`` (the model's own cache in its dtype), a
``bundle`` (its codes through :class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache` with the bundle's serving
defaults) or a ``baseline`` (:mod:`loopvq_calib.codes.baselines`, the same cache). ``--sink-tokens`` /
``--recent-window`` override the sinks and window of every quantized entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..codes.baselines import make_baseline
from ..models.cache import LoopKVCache
from ..serving.cache import QuantizedLoopKVCache
from .harness import run_tasks
from .options import ServedOptions
from .passkey import run_passkey

DEFAULT_SERVING = {"sink_tokens": 8, "recent_window": 64}  # baselines' defaults when no bundle is given


@dataclass
class Entry:
    """One way of serving the model."""

    name: str
    kind: str  # "full-precision" | "bundle" | "baseline"
    quantizer: Any = None
    sink_tokens: int = 0
    recent_window: int = 0
    page_size: int = 8

    def make_cache(self) -> Callable[[], QuantizedLoopKVCache] | None:
        """A cache factory for :class:`~loopvq_calib.evaluation.harness.ServedLM` (``None``: full precision)."""
        if self.quantizer is None:
            return None
        q, s, w, p = self.quantizer, self.sink_tokens, self.recent_window, self.page_size
        return lambda: QuantizedLoopKVCache(q, sink_tokens=s, recent_window=w, page_size=p)

    def describe(self) -> dict[str, Any]:
        """The entry as the report lists it: name, kind, method, bits and serving settings."""
        q = self.quantizer
        return {
            "name": self.name,
            "kind": self.kind,
            "method": q.method if q is not None else "full-precision",
            "bits": q.bits() if q is not None else None,
            "serving": None
            if q is None
            else {"sink_tokens": self.sink_tokens, "recent_window": self.recent_window, "page_size": self.page_size},
        }


def _serving(options: ServedOptions, base: dict[str, Any]) -> tuple[int, int]:
    """(sink tokens, recent window): the options' overrides, else ``base``'s (a bundle's serving defaults)."""
    s = options.sink_tokens if options.sink_tokens is not None else int(base["sink_tokens"])
    w = options.recent_window if options.recent_window is not None else int(base["recent_window"])
    return s, w


def build_entries(model: torch.nn.Module, bundles: list[Any], options: ServedOptions, *, dtype: str) -> list[Entry]:
    """The full-precision entry, one per bundle (serving defaults, overridable) and one per baseline."""
    entries = [Entry(dtype, "full-precision")]
    for b in bundles:
        s, w = _serving(options, b.serving)
        entries.append(Entry(b.meta.get("name", b.path.name), "bundle", b.quantizer, s, w, int(b.serving["page_size"])))
    s, w = _serving(options, bundles[0].serving if bundles else DEFAULT_SERVING)
    for name in options.baselines:
        q = make_baseline(name, model.kv_layout())
        entries.append(Entry(name, "baseline", q, s, w, q.page_size))
    return entries


def baseline_entries(
    model: torch.nn.Module, bundles: list[Any], options: ServedOptions | None
) -> list[tuple[Any, int]]:
    """(baseline quantizer, sink tokens) pairs for the evaluation KL, with the entries' sink count."""
    if options is None:
        return []
    sink, _ = _serving(options, bundles[0].serving if bundles else DEFAULT_SERVING)
    return [(make_baseline(name, model.kv_layout()), sink) for name in options.baselines]


def model_details(model: torch.nn.Module) -> dict[str, Any]:
    """Loop count, and what the architecture adds (its ``loop_details`` hook: Huginn's recurrence count and how
    the initial state is drawn)."""
    return {"model_type": model.config.model_type, "loop_steps": model.kv_layout().loop_steps, **model.loop_details()}


# -- task accuracy ----------------------------------------------------------------------------------------
def primary_metric(metrics: dict[str, float]) -> str | None:
    """The metric a task is judged by: the first one lm-eval reports."""
    return next(iter(metrics), None)


def accuracy_drops(task_results: dict[str, Any], reference: str) -> dict[str, dict[str, float]]:
    """Per entry and task: the primary metric of ``reference`` minus the entry's (positive = worse)."""
    ref = task_results["scores"][reference]
    drops: dict[str, dict[str, float]] = {}
    for name, per_task in task_results["scores"].items():
        if name == reference:
            continue
        drops[name] = {}
        for task, metrics in per_task.items():
            key = primary_metric(ref.get(task, {}))
            if key is not None and key in metrics:
                drops[name][task] = ref[task][key] - metrics[key]
    return drops


def check_accuracy_gate(drops: dict[str, dict[str, float]], max_drop: float | None) -> list[str]:
    """One message per (entry, task) whose accuracy drop exceeds ``max_drop`` (NaN fails)."""
    if max_drop is None:
        return []
    return [
        f"{name}: {task} accuracy drop {d:.4g} exceeds --max-accuracy-drop {max_drop:g}"
        for name, per_task in drops.items()
        for task, d in per_task.items()
        if not d <= max_drop
    ]


# -- bytes per token ------------------------------------------------------------------------------------
@torch.no_grad()
def measured_bytes(model: torch.nn.Module, entry: Entry, ids: torch.Tensor) -> dict[str, Any]:
    """Bytes per token held after prefilling ``ids`` [1, L] through the entry's cache (its actual tensors)."""
    factory = entry.make_cache()
    cache = factory() if factory is not None else LoopKVCache()
    torch.manual_seed(0)
    model(ids, cache=cache, use_cache=True)
    kv = model.kv_layout()
    bf16 = kv.num_sites * 2 * kv.kv_heads * kv.head_dim * 2
    if factory is None:
        per = cache.nbytes() / ids.numel()
        return {
            "tokens": ids.shape[1],
            "cache_bytes": cache.nbytes(),
            "bytes_per_token": per,
            "encoded_bytes_per_token": None,
            "bf16_bytes_per_token": bf16,
            "ratio_to_bf16": per / bf16,
        }
    m = cache.bytes_per_token()
    return {
        k: m[k]
        for k in (
            "tokens",
            "cache_bytes",
            "bytes_per_token",
            "encoded_bytes_per_token",
            "bf16_bytes_per_token",
            "ratio_to_bf16",
        )
    }


# -- the served part of the report -----------------------------------------------------------------------
def served_evaluation(
    model: torch.nn.Module,
    tokenizer: Any,
    bundles: list[Any],
    *,
    options: ServedOptions,
    dtype: str,
    sample: torch.Tensor,
) -> dict[str, Any]:
    """Entries, measured bytes per token (after prefilling ``sample`` [1, L]), task scores with accuracy
    drops against full precision, and passkey accuracy per length."""
    entries = build_entries(model, bundles, options, dtype=dtype)
    out: dict[str, Any] = {
        "model": model_details(model),
        "reference": entries[0].name,
        "entries": [e.describe() for e in entries],
    }
    for row, e in zip(out["entries"], entries):
        row["bytes"] = measured_bytes(model, e, sample)
    if options.tasks:
        out["tasks"] = run_tasks(model, tokenizer, entries, options=options)
        out["accuracy_drop"] = accuracy_drops(out["tasks"], entries[0].name)
    if options.passkey_lengths:
        out["passkey"] = run_passkey(
            model, tokenizer, entries, lengths=options.passkey_lengths, trials=options.passkey_trials, seed=options.seed
        )
    return out
