"""Evaluation of calibrated quantizers against the full-precision model (the ``loopvq-eval`` logic).

The KL reported here is the *evaluation KL*: measured on held-out text the calibration never saw (the
calibration's own held-out number, which picked the fine-tuning epoch, is the *selection KL*). Every metric is measured on held-out sequences with the sink tokens kept in full precision and every
other position's keys/values replaced by decode(encode(.)) of the sequence's full-precision cache, at all
sites at once (no recent window: the worst case a served sequence sees); docs/evaluation.md defines them.
The teacher forward of a sequence is computed once and shared by every quantizer evaluated on it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from ..codes.objective import (
    Teacher,
    kl_per_position,
    next_token_nll,
    quantized_logits,
    teacher,
)
from ..codes.quantizer import KVQuantizer
from .served import (
    ServedOptions,
    baseline_entries,
    check_accuracy_gate,
    served_evaluation,
)

DEFAULT_DATA = Path("artifacts/data/shakespeare-heldout.jsonl")
KINDS = ("key", "value")
EVAL_DATA_NAMES = {"dataset": "--data", "num_sequences": "--num-sequences", "sequence_length": "--sequence-length",
                   "type": None, "text_field": None}  # how loopvq-eval's data errors name the setting


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
        kv = self.q.kv
        nmse = {kind: _ratio(sum(self.err[kind].values()), sum(self.ref[kind].values())) for kind in KINDS}
        per_site = [
            {"site": s.site, "step": s.step, "layer": s.layer, "stage": s.stage,
             **{kind: _ratio(self.err[kind][s.site], self.ref[kind][s.site]) for kind in KINDS}}
            for s in kv.sites
        ]
        per_step_nmse = {}
        for kind in KINDS:
            per_step_nmse[kind] = [
                _ratio(sum(self.err[kind][s.site] for s in kv.sites if s.looped and s.step == t),
                       sum(self.ref[kind][s.site] for s in kv.sites if s.looped and s.step == t))
                for t in range(kv.loop_steps)
            ]
        ppl_fp = math.exp(self.nll_fp / self.targets)
        ppl_q = math.exp(self.nll_q / self.targets)
        return {
            "method": self.q.method, "bits": self.q.bits(), "codebook_bytes": self.q.codebook_bytes(),
            "codebook_size": self.q.codebook_size, "group_size": self.q.group_size,
            "steps_per_block": self.q.steps_per_block, "sink_tokens": self.sink, "sequences": self.sequences,
            "kl_positions": int(self.positions), "nll_targets": int(self.targets),
            "eval_kl": self.kl / self.positions,
            "ppl_fp": ppl_fp, "ppl_quantized": ppl_q, "ppl_increase": ppl_q / ppl_fp - 1.0,
            "per_step_kl": [v / self.positions for v in self.step_kl] if per_step else None,
            "nmse": nmse, "nmse_per_step": per_step_nmse, "nmse_per_site": per_site,
        }


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def evaluate_quantizers(model: torch.nn.Module, sequences: torch.Tensor, entries: list[tuple[KVQuantizer, int]],
                        *, per_step: bool = True, kl_chunk: int = 1024) -> list[dict[str, Any]]:
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


def evaluate_quantizer(model: torch.nn.Module, sequences: torch.Tensor, quantizer: KVQuantizer, *, sink_tokens: int,
                       per_step: bool = True, kl_chunk: int = 1024) -> dict[str, Any]:
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
            failures.append(f"{r['name']}: perplexity increase {r['ppl_increase']:.4%} "
                            f"({r['ppl_fp']:.4f} -> {r['ppl_quantized']:.4f}) exceeds --max-ppl-increase "
                            f"{max_ppl_increase:g}")
    return failures


# -- the CLI logic -------------------------------------------------------------------------------------
class EvalInputError(ValueError):
    """Bad input to ``loopvq-eval`` (missing bundle, model or data); exit status 2."""


def run_eval(bundles: list[str], model: str | None, data: str | None, *, num_sequences: int, sequence_length: int,
             out_dir: str | None, max_kl: float | None, max_ppl_increase: float | None,
             device: str = "auto", dtype: str = "float32", served: ServedOptions | None = None) -> int:
    """Evaluate bundles side by side on the same held-out sequences, write the report, apply the gates.

    ``served`` adds the baselines (evaluation KL too) and the served-cache evaluation (lm-eval tasks, passkey,
    bytes per token; :mod:`loopvq_calib.evaluation.served`). Returns 0 (all gates pass), 1 (a gate failed; each failure
    is printed) or 2 (bad input).
    """
    from ..bundle.reader import BundleError
    from ..data.files import DataError
    from ..models.loading import ModelLoadError

    try:
        check_served_options(served)
        data = _data_source(data, num_sequences, sequence_length)
        _check_gates_and_out(out_dir, max_kl, max_ppl_increase)
        if device != "auto" and device != "cpu" and not device.startswith("cuda"):
            raise EvalInputError(f"--device {device!r} is not allowed; use auto, cpu, cuda or cuda:N")
        loaded, model_obj, tokenizer, model_name = _load_inputs(bundles, model, device, dtype=dtype)
        for b in loaded:
            if sequence_length <= max(b.serving["sink_tokens"], 1):
                raise EvalInputError(f"--sequence-length {sequence_length} leaves no position after the "
                                     f"{b.serving['sink_tokens']} sink tokens of {b.path}")
        sequences, data_desc = _heldout(data, tokenizer, num_sequences, sequence_length=sequence_length)
    except (EvalInputError, BundleError, ModelLoadError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dev = next(model_obj.parameters()).device
    entries = [(b.quantizer.to(dev), int(b.serving["sink_tokens"])) for b in loaded]
    baselines = baseline_entries(model_obj, loaded, served)
    results = evaluate_quantizers(model_obj, sequences, entries + baselines)
    for b, r in zip(loaded, results):
        metrics = b.meta.get("metrics") or {}
        r.update(name=b.meta.get("name", b.path.name), bundle=str(b.path), serving=b.serving,
                 selection_kl=metrics.get("selection_kl", metrics.get("heldout_kl")),
                 finetune_curve=metrics.get("finetune_curve"))
    for (q, _), r in zip(baselines, results[len(loaded):]):
        r.update(name=q.method, bundle=None, serving=None, selection_kl=None, finetune_curve=None, baseline=True)
    report = {"model": model_name, "dtype": dtype, "device": str(dev), "data": data_desc,
              "loop_steps": loaded[0].quantizer.kv.loop_steps, "bundles": results}
    gate_failures: list[str] = []
    if served is not None and (served.tasks or served.passkey_lengths or served.baselines):
        report["served"] = served_evaluation(model_obj, tokenizer, loaded, options=served, dtype=dtype, sample=sequences[:1].to(dev))
        gate_failures = check_accuracy_gate(report["served"].get("accuracy_drop") or {}, served.max_accuracy_drop)
    from .report import markdown_report, write_report

    print(markdown_report(report))
    if out_dir is not None:
        for path in write_report(report, Path(out_dir)):
            print(f"wrote {path}")
    failures = check_gates(results, max_kl, max_ppl_increase) + gate_failures
    for f in failures:
        print(f"gate failed: {f}")
    return 1 if failures else 0


def check_served_options(served: ServedOptions | None) -> None:
    """Baseline names, task names (lm-eval's registry plus the shipped tasks), passkey lengths and the
    serving overrides, checked before any model is loaded."""
    from ..codes.baselines import BASELINES
    from .served import task_manager

    if served is None:
        return
    unknown = [b for b in served.baselines if b not in BASELINES]
    if unknown:
        raise EvalInputError(f"--baseline {','.join(unknown)}: unknown; expected some of {','.join(BASELINES)}")
    for flag, value in (("--sink-tokens", served.sink_tokens), ("--recent-window", served.recent_window)):
        if value is not None and value < 0:
            raise EvalInputError(f"{flag} must be >= 0, got {value}")
    if served.limit is not None and not served.limit > 0:
        raise EvalInputError(f"--limit must be > 0, got {served.limit:g}")
    if served.batch_size < 1 or served.passkey_trials < 1:
        raise EvalInputError(f"--batch-size and --passkey-trials must be >= 1, got {served.batch_size}, "
                             f"{served.passkey_trials}")
    if any(n < 16 for n in served.passkey_lengths):
        raise EvalInputError(f"--passkey-lengths {served.passkey_lengths}: each length must be >= 16 tokens")
    for path in served.include_path:
        if not Path(path).is_dir():
            raise EvalInputError(f"--include-path {path}: no such folder")
    if served.tasks or served.passkey_lengths:
        try:
            import lm_eval  # noqa: F401
        except ImportError as err:
            raise EvalInputError("--tasks / --passkey-lengths need lm-evaluation-harness: pip install "
                                 "'loopvq-calib[eval]'") from err
    if served.tasks:
        known = set(task_manager(served.include_path, served.tasks).all_tasks)
        missing = [t for t in served.tasks if t not in known]
        if missing:
            raise EvalInputError(f"--tasks {','.join(missing)}: not an lm-eval task or group here (the shipped "
                                 "local task is loopvq_kjv_phrases; add task folders with --include-path)")


def _load_inputs(paths: list[str], model: str | None, device: str, *, dtype: str):
    """Bundles (each checked against the model's identity), the model, its tokenizer and its name."""
    from ..bundle.reader import BundleError, load_bundle, resolve_bundle_dir
    from ..models.loading import (
        ModelLoadError,
        load_model,
        pick_device,
        resolve_model_dir,
    )

    if not paths:
        raise EvalInputError("no bundle given (--bundle PATH, repeatable)")
    dirs = []
    for p in paths:
        try:
            dirs.append(resolve_bundle_dir(p, key="--bundle"))
        except BundleError as err:
            raise EvalInputError(f"--bundle {err}" if not str(err).startswith("--bundle") else str(err)) from err
    first = [load_bundle(d) for d in dirs]
    idents = [b.meta["model"] for b in first]
    if model is None:
        names = {i["name"] for i in idents}
        if len(names) > 1:
            raise EvalInputError(f"the bundles were calibrated for different models ({', '.join(sorted(names))}); "
                                 "evaluate them separately or name one with --model")
        model, revision = idents[0]["name"], idents[0].get("revision")
        try:
            folder = resolve_model_dir(model, revision, key=f"{dirs[0]}: the bundle's model")
        except ModelLoadError as err:
            raise EvalInputError(f"{err}; pass the model with --model FOLDER_OR_HUB_ID") from err
    else:
        folder = resolve_model_dir(model, None, key="--model")
    loaded = [load_bundle(d, model=folder) for d in dirs]
    layouts = {json.dumps(b.meta["kv_layout"], sort_keys=True) for b in loaded}
    if len(layouts) > 1:
        raise EvalInputError("the bundles have different KV layouts (loop counts); evaluate them separately")
    steps = loaded[0].quantizer.kv.loop_steps
    model_obj, tokenizer = load_model(folder, dtype, pick_device(device), loop_steps=steps)
    if model_obj.kv_layout() != loaded[0].quantizer.kv:
        raise EvalInputError(f"{loaded[0].path}: its KV layout does not match model {model} at {steps} loop steps")
    return loaded, model_obj, tokenizer, model


def _check_gates_and_out(out_dir: str | None, max_kl: float | None, max_ppl_increase: float | None) -> None:
    """--out must be a folder (or not exist yet); gate thresholds finite and >= 0."""
    if out_dir is not None and Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise EvalInputError(f"--out {out_dir}: exists and is not a folder")
    for flag, value in (("--max-kl", max_kl), ("--max-ppl-increase", max_ppl_increase)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise EvalInputError(f"{flag} must be a finite number >= 0, got {value}")


def _data_source(data: str | None, num_sequences: int, sequence_length: int) -> str:
    """Check the held-out data argument before anything is loaded; ``None`` -> the shipped default file."""
    from ..config.schema import DataConfig
    from ..config.source import LOCAL_TYPES
    from ..data.corpus import load_documents, local_files

    if num_sequences < 1 or sequence_length < 2:
        raise EvalInputError(f"need --num-sequences >= 1 and --sequence-length >= 2, got {num_sequences}, "
                             f"{sequence_length}")
    if data is None:
        candidates = [DEFAULT_DATA, Path(__file__).resolve().parents[2] / DEFAULT_DATA]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise EvalInputError(f"no --data given and the default {DEFAULT_DATA} does not exist here")
        return str(found)
    looks_local = Path(data).suffix in LOCAL_TYPES or data.startswith((".", "/", "~"))  # else maybe a hub name
    if looks_local and not any(ch in data for ch in "*?[") and not Path(data).expanduser().exists():
        raise EvalInputError(f"--data {data}: no such file or folder")
    data = str(Path(data).expanduser()) if looks_local else data
    if local_files(data):  # read it now (UTF-8, parseable, some text) before any model is loaded
        if next(load_documents(DataConfig(dataset=data), EVAL_DATA_NAMES), None) is None:
            raise EvalInputError(f"--data {data}: holds no text (no non-empty 'text' field or line)")
    return data


def _heldout(data: str, tokenizer: Any, num_sequences: int, *, sequence_length: int) -> tuple[torch.Tensor, dict]:
    """Held-out token windows [n, L] of ``data`` (local file/folder/glob or hub dataset)."""
    from ..config.schema import DataConfig
    from ..data.corpus import build_calibration_set

    cfg = DataConfig(dataset=data, num_sequences=num_sequences, sequence_length=sequence_length, heldout_sequences=0)
    calib = build_calibration_set(cfg, tokenizer, EVAL_DATA_NAMES)
    return calib.input_ids, calib.description
