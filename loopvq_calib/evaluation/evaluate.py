"""Evaluation of calibrated quantizers against the full-precision model: :func:`evaluate` (the ``loopvq-eval``
logic) and the metrics it reports.

The KL reported here is the *evaluation KL*: measured on held-out text the calibration never saw (the
calibration's own held-out number, which picked the fine-tuning epoch, is the *selection KL*). Every metric is
measured on held-out sequences with the sink tokens kept in full precision and every other position's keys/values
replaced by decode(encode(.)) of the sequence's full-precision cache, at all sites at once (no recent window: the
worst case a served sequence sees); docs/evaluation.md defines them. The teacher forward of a sequence is
computed once and shared by every quantizer evaluated on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..codes.layouts import KINDS
from ..codes.objective import Teacher, kl_per_position, next_token_nll, quantized_logits, teacher
from ..codes.quantizer import KVQuantizer
from .inputs import (
    EvalInputs,
    check_device,
    check_gate_thresholds,
    check_served_options,
    check_sink_room,
    data_source,
    heldout_sequences,
    load_inputs,
)
from .options import Gates, ServedOptions
from .served import baseline_entries, check_accuracy_gate, served_evaluation


class _Sums:
    """Running sums of one quantizer's metrics over sequences."""

    def __init__(self, quantizer: KVQuantizer, sink_tokens: int) -> None:
        self.q, self.sink = quantizer, sink_tokens
        self.kl = self.positions = self.nll_fp = self.nll_q = self.targets = 0.0
        self.step_kl = [0.0] * quantizer.kv.loop_steps
        self.err = {kind: {s.site: 0.0 for s in quantizer.kv.sites} for kind in KINDS}
        self.ref = {kind: {s.site: 0.0 for s in quantizer.kv.sites} for kind in KINDS}
        self.sequences = 0

    @torch.no_grad()
    def add(self, model: torch.nn.Module, ids: torch.Tensor, fp: Teacher, *, per_step: bool, kl_chunk: int) -> None:
        """Add sequence ``ids`` [1, L], whose full-precision forward is ``fp``."""
        s = self.sink
        if ids.shape[1] <= max(s, 1):
            raise ValueError(f"sequences of {ids.shape[1]} tokens leave no position after {s} sink tokens")
        qk, qv = self.q.quantize_sites(fp.keys, fp.values)  # encoded once, reused below
        q_logits = quantized_logits(model, ids, self.q, fp=fp, sink_tokens=s, quantized=(qk, qv))
        kl = kl_per_position(fp.logits[:, s:], q_logits[:, s:], kl_chunk)
        self.kl += kl.sum().item()
        self.positions += kl.numel()
        self.nll_fp += next_token_nll(fp.logits, ids, s).item()
        self.nll_q += next_token_nll(q_logits, ids, s).item()
        self.targets += ids.shape[0] * (ids.shape[1] - max(s, 1))
        for kind, x, y in (("key", fp.keys, qk), ("value", fp.values, qv)):
            for site in self.err[kind]:
                ref, rec = x[site][:, s:].float(), y[site][:, s:].float()
                self.err[kind][site] += (ref - rec).pow(2).sum().item()
                self.ref[kind][site] += ref.pow(2).sum().item()
        if per_step:
            for t in range(len(self.step_kl)):
                q_t = quantized_logits(model, ids, self.q, fp=fp, sink_tokens=s, only_steps={t}, quantized=(qk, qv))
                self.step_kl[t] += kl_per_position(fp.logits[:, s:], q_t[:, s:], kl_chunk).sum().item()
        self.sequences += ids.shape[0]

    def result(self, per_step: bool) -> dict[str, Any]:
        """The metrics over the sequences added (docs/evaluation.md)."""
        kv = self.q.kv
        nmse = {kind: _ratio(sum(self.err[kind].values()), sum(self.ref[kind].values())) for kind in KINDS}
        per_site = [
            {
                "site": s.site,
                "step": s.step,
                "layer": s.layer,
                "stage": s.stage,
                **{kind: _ratio(self.err[kind][s.site], self.ref[kind][s.site]) for kind in KINDS},
            }
            for s in kv.sites
        ]
        per_step_nmse = {}
        for kind in KINDS:
            per_step_nmse[kind] = [
                _ratio(
                    sum(self.err[kind][s.site] for s in kv.sites if s.looped and s.step == t),
                    sum(self.ref[kind][s.site] for s in kv.sites if s.looped and s.step == t),
                )
                for t in range(kv.loop_steps)
            ]
        ppl_fp = math.exp(self.nll_fp / self.targets)
        ppl_q = math.exp(self.nll_q / self.targets)
        return {
            "method": self.q.method,
            "bits": self.q.bits(),
            "codebook_bytes": self.q.codebook_bytes(),
            "codebook_size": self.q.codebook_size,
            "group_size": self.q.group_size,
            "steps_per_block": self.q.steps_per_block,
            "sink_tokens": self.sink,
            "sequences": self.sequences,
            "kl_positions": int(self.positions),
            "nll_targets": int(self.targets),
            "eval_kl": self.kl / self.positions,
            "ppl_fp": ppl_fp,
            "ppl_quantized": ppl_q,
            "ppl_increase": ppl_q / ppl_fp - 1.0,
            "per_step_kl": [v / self.positions for v in self.step_kl] if per_step else None,
            "nmse": nmse,
            "nmse_per_step": per_step_nmse,
            "nmse_per_site": per_site,
        }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def evaluate_quantizers(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    entries: list[tuple[KVQuantizer, int]],
    *,
    per_step: bool = True,
    kl_chunk: int = 1024,
) -> list[dict[str, Any]]:
    """Metrics of several (quantizer, sink_tokens) pairs on the same sequences [n, L], one sequence at a
    time; each sequence's teacher forward is computed once and reused by every quantizer."""
    device = next(model.parameters()).device
    sums = [_Sums(q, s) for q, s in entries]
    for row in sequences:
        ids = row[None].to(device)
        fp = teacher(model, ids)
        for acc in sums:
            acc.add(model, ids, fp, per_step=per_step, kl_chunk=kl_chunk)
    return [acc.result(per_step) for acc in sums]


def evaluate_quantizer(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    quantizer: KVQuantizer,
    *,
    sink_tokens: int,
    per_step: bool = True,
    kl_chunk: int = 1024,
) -> dict[str, Any]:
    """Held-out KL, perplexities, NMSE per site and loop step, per-step KL table, bits and codebook bytes
    of ``quantizer`` on ``sequences`` [n, L] (docs/evaluation.md). The quantizer must be on the model's device."""
    return evaluate_quantizers(model, sequences, [(quantizer, sink_tokens)], per_step=per_step, kl_chunk=kl_chunk)[0]


def check_gates(results: list[dict[str, Any]], max_kl: float | None, max_ppl_increase: float | None) -> list[str]:
    """One message per (bundle, gate) that failed: evaluation KL above ``max_kl``, relative perplexity
    increase above ``max_ppl_increase``."""
    failures = []
    for r in results:
        if max_kl is not None and not r["eval_kl"] <= max_kl:
            failures.append(f"{r['name']}: evaluation KL {r['eval_kl']:.6g} exceeds --max-kl {max_kl:g}")
        if max_ppl_increase is not None and not r["ppl_increase"] <= max_ppl_increase:
            failures.append(
                f"{r['name']}: perplexity increase {r['ppl_increase']:.4%} "
                f"({r['ppl_fp']:.4f} -> {r['ppl_quantized']:.4f}) exceeds --max-ppl-increase "
                f"{max_ppl_increase:g}"
            )
    return failures


@dataclass(frozen=True)
class EvalReport:
    """What :func:`evaluate` measured: ``report`` (report.json's content: model, dtype, device, data, loop steps,
    one row per bundle and baseline in ``bundles``, and the served-cache evaluation in ``served`` when one ran)
    and one message per failed gate."""

    report: dict[str, Any]
    gate_failures: list[str]

    @property
    def passed(self) -> bool:
        """Whether every gate passed."""
        return not self.gate_failures


def evaluate(
    bundles: Sequence[str | Path],
    *,
    model: str | None = None,
    data: str | None = None,
    num_sequences: int = 8,
    sequence_length: int = 512,
    device: str = "auto",
    dtype: str = "float32",
    served: ServedOptions | None = None,
    gates: Gates | None = None,
) -> EvalReport:
    """Evaluate bundles (folders or hub ids) side by side on the same held-out sequences and apply the gates.

    ``model``: folder or hub id (default: the bundles' model); ``data``: held-out text (default: the shipped
    held-out file); ``served`` adds the baselines (evaluation KL too) and the served-cache evaluation (lm-eval
    tasks, passkey, bytes per token; :mod:`loopvq_calib.evaluation.served`). Bad input raises before any model is
    loaded where it can (:class:`~loopvq_calib.evaluation.inputs.EvalInputError`, BundleError, ModelLoadError,
    DataError): the model folder's files and ``sequence_length`` (and the passkey lengths) against the model's
    window are checked before its weights are read."""
    gates = gates or Gates()
    check_served_options(served)
    source = data_source(data, num_sequences, sequence_length)
    check_gate_thresholds(gates)
    check_device(device)
    inputs = load_inputs(
        bundles,
        model,
        device,
        dtype=dtype,
        sequence_length=sequence_length,
        passkey_lengths=served.passkey_lengths if served is not None else (),
    )
    check_sink_room(inputs.bundles, sequence_length)
    sequences, description = heldout_sequences(source, inputs.tokenizer, num_sequences, sequence_length=sequence_length)
    report = {
        "model": inputs.model_name,
        "dtype": dtype,
        "device": str(next(inputs.model.parameters()).device),
        "data": description,
        "loop_steps": inputs.bundles[0].quantizer.kv.loop_steps,
        "bundles": _result_rows(inputs, sequences, served),
    }
    failures = check_gates(report["bundles"], gates.max_kl, gates.max_ppl_increase)
    if served is not None and served.any_served:
        sample = sequences[:1].to(next(inputs.model.parameters()).device)
        report["served"] = served_evaluation(
            inputs.model, inputs.tokenizer, inputs.bundles, options=served, dtype=dtype, sample=sample
        )
        failures += check_accuracy_gate(report["served"].get("accuracy_drop") or {}, gates.max_accuracy_drop)
    return EvalReport(report, failures)


def _result_rows(inputs: EvalInputs, sequences: torch.Tensor, served: ServedOptions | None) -> list[dict[str, Any]]:
    """The metrics of every bundle, then every baseline, each with its name, path, serving and selection KL."""
    dev = next(inputs.model.parameters()).device
    loaded = inputs.bundles
    entries = [(b.quantizer.to(dev), int(b.serving["sink_tokens"])) for b in loaded]
    baselines = baseline_entries(inputs.model, loaded, served)
    results = evaluate_quantizers(inputs.model, sequences, entries + baselines)
    for b, r in zip(loaded, results):
        metrics = b.meta.get("metrics") or {}
        r.update(
            name=b.meta.get("name", b.path.name),
            bundle=str(b.path),
            serving=b.serving,
            codebooks_sha256=b.meta["files"]["codebooks.safetensors"]["sha256"],
            selection_kl=metrics.get("selection_kl", metrics.get("heldout_kl")),
            finetune_curve=metrics.get("finetune_curve"),
        )
    for (q, _), r in zip(baselines, results[len(loaded) :]):
        r.update(
            name=q.method,
            bundle=None,
            serving=None,
            codebooks_sha256=None,
            selection_kl=None,
            finetune_curve=None,
            baseline=True,
        )
    return results
