"""The checks of benchmarks/decode/bench_decode_model.py, run before its timed cases: per method, one greedy decode step
on a random fill, its logits through the coded cache as served and through its reference path against the model's own
cache holding the decoded contents, then the per-site check (benchmarks/decode/site_check.py). The greedy step is the
one the timed cases take."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import torch

from benchmarks.decode.decode_fill import Serving, decoded_cache, fill_cache, random_contents
from benchmarks.decode.site_check import SiteCheckCache
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.serving.cache import QuantizedLoopKVCache


def decode_step(model: torch.nn.Module, cache: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy step: (next token ids [B, 1], logits [B, V])."""
    logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


@torch.inference_mode()
def check_fill(
    model: torch.nn.Module,
    quantizer: KVQuantizer,
    serving: Serving,
    *,
    context: int,
    batch: int,
    device: torch.device,
    seed: int = 0,
    backend: str = "auto",
) -> dict[str, Any]:
    """One decode step on one random fill: logits through the coded cache as served (``backend``) and its
    reference path (``"torch"``), each against the model's own cache holding the decoded contents; then the
    per-site check (:class:`SiteCheckCache`: served against reference at every site, teacher-forced), whose
    logits must be the reference path's exactly."""
    gen = torch.Generator(device).manual_seed(seed)
    contents = random_contents(quantizer, serving, context, batch=batch, device=device, gen=gen)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device, generator=gen)
    _, want = decode_step(model, decoded_cache(quantizer, contents, serving), ids)
    out = {"context": context, "batch": batch, "method": quantizer.method}

    def filled(path: str) -> QuantizedLoopKVCache:
        return fill_cache(QuantizedLoopKVCache(quantizer, **dataclasses.asdict(serving), backend=path), **contents)

    logits = {}
    for path, name in ((backend, "served"), ("torch", "reference")):
        cache = filled(path)
        _, logits[name] = decode_step(model, cache, ids)
        diff = logits[name].float() - want.float()
        out[f"{name}_max_abs_diff"] = float(diff.abs().max())
        out[f"{name}_relative_error"] = float(diff.norm() / want.float().norm())
        out[f"{name}_same_argmax"] = bool(torch.equal(logits[name].argmax(-1), want.argmax(-1)))
        if name == "served":
            out["served_path"] = "kernel" if cache.served_by_kernel else "reference"
    site = SiteCheckCache(filled(backend), filled("torch"))
    _, got = decode_step(model, site, ids)
    out.update(site.summary(), site_logits_are_reference=bool(torch.equal(got, logits["reference"])))
    return out


def run_checks(
    model: torch.nn.Module,
    quantizers: dict[str, KVQuantizer],
    serving: Serving,
    *,
    result: dict[str, Any],
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    """:func:`check_fill` per method into ``result["checks"]``, printed and saved as they come."""
    for name, q in quantizers.items():
        result["checks"].append(
            check_fill(
                model,
                q,
                serving,
                context=args.check_context,
                batch=args.check_batch,
                device=device,
                seed=args.seed,
                backend=args.check_kernel,
            )
        )
        c = result["checks"][-1]
        c["method"] = name  # the cache's name: tasq+loopvq-channels is a tasq+loopvq quantizer
        print(json.dumps(c), flush=True)
        print(
            f"{c['method']}: per-site relative error (served by {c['site_served_path']}) max "
            f"{c['site_relative_error_max']:.3g}, median {c['site_relative_error_median']:.3g}",
            flush=True,
        )
        args.out.write_text(json.dumps(result, indent=1))
