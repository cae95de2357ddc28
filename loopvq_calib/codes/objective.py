"""The quantity LoopVQ optimises and reports: KL from the full-precision output to the quantized one.

``teacher`` runs the frozen model in full precision and records every site's pre-RoPE keys/values.
``quantized_logits`` reruns it with the keys/values after the sink tokens replaced by decode(encode(.))
of that full-precision cache (docs/method.md section 8, the paper's eq. 6), optionally only at some loop steps.
Both run inside :func:`shared_initial_state`, so a model with a random initial state (Huginn ``like-init``)
starts the teacher and the quantized forward of one sequence from the same state.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.sites import KVRecorder, KVSubstituter, kv_hook
from .quantizer import KVQuantizer


@dataclass
class Teacher:
    """Full-precision logits [B, S, V] and pre-RoPE keys/values per site [B, S, H, D]."""

    logits: torch.Tensor
    keys: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]


def shared_initial_state(model: torch.nn.Module) -> AbstractContextManager:
    """Forwards inside draw each sequence's random initial state from a seed of its tokens (models with
    ``seeded_initial_state``, i.e. Huginn); a no-op for models without a random state."""
    seeded = getattr(model, "seeded_initial_state", None)
    return seeded() if seeded is not None else nullcontext()


@torch.no_grad()
def teacher(model: torch.nn.Module, ids: torch.Tensor) -> Teacher:
    """The full-precision forward of ``ids`` [B, S]: its logits and every site's pre-RoPE keys and values."""
    rec = KVRecorder()
    with kv_hook(model, rec), shared_initial_state(model):
        logits = model(ids, use_cache=False).logits
    return Teacher(logits, rec.keys, rec.values)


def sink_mask(ids: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """[B, S] True where a position is quantized (after the sinks)."""
    mask = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    mask[:, :sink_tokens] = False
    return mask


def quantized_logits(
    model: torch.nn.Module,
    ids: torch.Tensor,
    quantizer: KVQuantizer,
    *,
    fp: Teacher,
    sink_tokens: int,
    only_steps: set[int] | None = None,
    quantized: tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Logits when every site (or only the sites of ``only_steps``) attends to the quantized cache.

    Gradients flow to the codebooks through the lookup; assignments are recomputed, without gradient,
    from the current codebooks. ``quantized`` passes an already computed ``quantize_sites`` result.
    """
    if quantized is None:  # cast once per block to the forward's dtype (the teacher's, under the same autocast)
        quantized = quantizer.quantize_sites(fp.keys, fp.values, dtype=next(iter(fp.keys.values())).dtype)
    qk, qv = quantized
    if only_steps is not None:
        keep = {s.site for s in quantizer.kv.sites if s.looped and s.step in only_steps}
        qk = {s: t for s, t in qk.items() if s in keep}
    sub = KVSubstituter(lambda site: (qk[site], qv[site]) if site in qk else None, sink_mask(ids, sink_tokens))
    with kv_hook(model, sub), shared_initial_state(model):
        return model(ids, use_cache=False).logits


def kl_per_position(p_logits: torch.Tensor, q_logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """KL(p || q) per position [B, S], computed in fp32 over chunks of positions (bounded memory)."""
    out = []
    for p, q in zip(p_logits.split(chunk, dim=1), q_logits.split(chunk, dim=1)):
        lp = F.log_softmax(p.float(), -1)
        lq = F.log_softmax(q.float(), -1)
        out.append((lp.exp() * (lp - lq)).sum(-1))
    return torch.cat(out, dim=1)


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, sink_tokens: int, *, chunk: int = 1024) -> torch.Tensor:
    """Mean KL over the positions after the sinks (the fine-tuning objective)."""
    return kl_per_position(p_logits[:, sink_tokens:], q_logits[:, sink_tokens:], chunk).mean()


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """Summed next-token negative log-likelihood over the targets after the sinks (at least position 1)."""
    tgt = ids[:, max(sink_tokens, 1) :]
    lg = logits[:, max(sink_tokens, 1) - 1 : -1]
    return F.cross_entropy(lg.flatten(0, 1).float(), tgt.flatten(), reduction="sum")
