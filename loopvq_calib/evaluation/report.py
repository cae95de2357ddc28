"""The ``loopvq-eval`` report: report.json, a side-by-side report.md and PNG plots (matplotlib, Agg), for the
evaluation KL part and the served-cache part alike.

The report dict is :attr:`loopvq_calib.evaluation.evaluate.EvalReport.report`: ``bundles`` is a list of per-bundle
(and per-baseline) results (:func:`loopvq_calib.evaluation.evaluate.evaluate_quantizer` plus name, bundle path,
serving, fine-tuning curve); ``served`` (optional) holds the served-cache evaluation
(:mod:`loopvq_calib.evaluation.served`). Reports that name the KLs ``heldout_kl`` and ``calibration_heldout_kl``
are read too. Loop steps are 0-based in JSON (as ``KVSite.step``) and labelled 1-based in report.md and the
plots, like the paper's tables.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from ..bundle.format import json_safe
from .out_folder import write_out_files
from .served import primary_metric


def _fmt(v: float | None, spec: str = ".4g") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def eval_kl(r: dict[str, Any]) -> float | None:
    """The evaluation KL of a result row (``heldout_kl`` in reports before the rename)."""
    return r.get("eval_kl", r.get("heldout_kl"))


def selection_kl(r: dict[str, Any]) -> float | None:
    """The bundle's calibration-time (selection) KL (``calibration_heldout_kl`` before the rename)."""
    return r.get("selection_kl", r.get("calibration_heldout_kl"))


def _bits(r: dict[str, Any]) -> str:
    return f"{r['bits']['key']:.3f} / {r['bits']['value']:.3f}"


def markdown_report(report: dict[str, Any]) -> str:
    """Side-by-side tables: method, bits, evaluation KL, perplexities, per-step KL, NMSE and, when the
    report has one, the served-cache evaluation (task accuracy, passkey, bytes per token)."""
    rows = report["bundles"]
    steps = report["loop_steps"]
    d = report.get("data") or {}
    lines = [
        "# LoopVQ evaluation",
        "",
        f"Model `{report['model']}` ({report['dtype']}, {report['device']}); held-out data `{d.get('dataset')}`: "
        f"{d.get('num_sequences')} sequences of {d.get('sequence_length')} tokens. The evaluation KL (text "
        "calibration never saw) and perplexity count the "
        "positions after each bundle's sink tokens; every other position's keys and values are quantized at "
        "every site (no recent window).",
        "",
    ]
    head = ["bundle", "method", "bits K / V", "sinks", "evaluation KL", "ppl fp", "ppl quantized", "ppl increase"]
    head += [f"KL step {t + 1} only" for t in range(steps)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["name"],
            r["method"],
            _bits(r),
            str(r["sink_tokens"]),
            _fmt(eval_kl(r), ".5f"),
            _fmt(r["ppl_fp"], ".3f"),
            _fmt(r["ppl_quantized"], ".3f"),
            f"{r['ppl_increase']:+.2%}",
        ]
        per = r.get("per_step_kl") or [None] * steps
        cells += [_fmt(v, ".5f") for v in per]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Reconstruction error (NMSE, non-sink tokens)", ""]
    head = ["bundle", "keys", "values"] + [f"K / V step {t + 1}" for t in range(steps)]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        n = r["nmse"]
        cells = [r["name"], _fmt(n["key"]), _fmt(n["value"])]
        cells += [f"{_fmt(k)} / {_fmt(v)}" for k, v in zip(r["nmse_per_step"]["key"], r["nmse_per_step"]["value"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Bundles",
        "",
        "| bundle | path | K | G | T_c | codebook bytes | selection KL (calibration) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("baseline"):
            continue
        lines.append(
            f"| {r['name']} | `{r['bundle']}` | {r['codebook_size']} | {r['group_size']} | "
            f"{r['steps_per_block']} | {r['codebook_bytes']:,} | {_fmt(selection_kl(r), '.5f')} |"
        )
    if report.get("served"):
        lines += served_markdown(report)
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write report.json, report.md and the plots into ``out_dir`` under ``--out``'s rules
    (:mod:`loopvq_calib.evaluation.out_folder`: never through a link, never over a file loopvq-eval did not write);
    returns the written paths."""
    # strict JSON, as loopvq-push reads it: non-finite numbers as the strings "nan", "inf", "-inf"
    files = {
        "report.json": (json.dumps(json_safe(report), indent=1, allow_nan=False) + "\n").encode("utf-8"),
        "report.md": markdown_report(report).encode("utf-8"),
    }
    return write_out_files(out_dir, {**files, **plots(report)})


def plots(report: dict[str, Any]) -> dict[str, bytes]:
    """kl_by_method.png, kl_per_step.png, nmse_per_step.png, finetune_curve.png when any bundle has a curve,
    served_accuracy.png when the report has task or passkey results and accuracy_vs_bytes.png when it has task
    results: name -> PNG bytes."""
    plt = _pyplot()
    rows, steps = report["bundles"], report["loop_steps"]
    figures = {
        "kl_by_method.png": lambda: _kl_by_method(plt, rows),
        "kl_per_step.png": lambda: _kl_per_step(plt, rows, steps),
        "nmse_per_step.png": lambda: _nmse_per_step(plt, rows, steps),
    }
    curves = [r for r in rows if r.get("finetune_curve")]
    if curves:
        figures["finetune_curve.png"] = lambda: _finetune_curves(plt, curves)
    served = report.get("served") or {}
    if served.get("tasks") or served.get("passkey"):
        figures["served_accuracy.png"] = lambda: _served_accuracy(plt, served)
    points = accuracy_points(served) if served.get("tasks") else []
    if points:
        figures["accuracy_vs_bytes.png"] = lambda: _accuracy_vs_bytes(plt, points)
    out = {}
    for name, draw in figures.items():  # each figure drawn, saved and closed before the next
        fig = draw()
        fig.tight_layout()
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=110)
        plt.close(fig)
        out[name] = image.getvalue()
    return out


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _kl_by_method(plt: Any, rows: list[dict[str, Any]]) -> Any:
    methods = sorted({r["method"] for r in rows})
    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(methods)}
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 1.5), 3.6))
    labels = [f"{r['name']}\n{r['method']}, {r['bits']['key']:.3g}/{r['bits']['value']:.3g} bit" for r in rows]
    ax.bar(range(len(rows)), [eval_kl(r) for r in rows], color=[colors[r["method"]] for r in rows])
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("evaluation KL to full precision")
    ax.set_title("KL per method and width")
    return fig


def _kl_per_step(plt: Any, rows: list[dict[str, Any]], steps: int) -> Any:
    x_steps = list(range(1, steps + 1))
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in rows:
        if r.get("per_step_kl"):
            ax.plot(x_steps, r["per_step_kl"], marker="o", label=r["name"])
    ax.set_xlabel("quantized loop step (only)")
    ax.set_ylabel("KL to full precision")
    ax.set_xticks(x_steps)
    ax.set_title("KL when one loop step is quantized")
    ax.legend(fontsize=7)
    return fig


def _nmse_per_step(plt: Any, rows: list[dict[str, Any]], steps: int) -> Any:
    x_steps = list(range(1, steps + 1))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=False)
    for ax, kind in zip(axes, ("key", "value")):
        for r in rows:
            ax.plot(x_steps, r["nmse_per_step"][kind], marker="o", label=r["name"])
        ax.set_xlabel("loop step")
        ax.set_ylabel("NMSE")
        ax.set_xticks(x_steps)
        ax.set_title(f"{kind}s")
    axes[0].legend(fontsize=7)
    return fig


def _finetune_curves(plt: Any, curves: list[dict[str, Any]]) -> Any:
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for r in curves:
        c = r["finetune_curve"]
        epochs = [e["epoch"] for e in c]
        line = ax.plot(
            epochs, [e.get("selection_kl", e.get("heldout_kl")) for e in c], marker="o", label=f"{r['name']} selection"
        )
        if any(e.get("train_kl") is not None for e in c):
            ax.plot(
                epochs, [e.get("train_kl") for e in c], ls="--", color=line[0].get_color(), label=f"{r['name']} train"
            )
    ax.set_xlabel("epoch (0 = k-means init)")
    ax.set_ylabel("KL to full precision")
    ax.set_title("Codebook fine-tuning")
    ax.legend(fontsize=7)
    return fig


# -- the served-cache part: markdown tables and served_accuracy.png ------------------------------------
def _serving(e: dict[str, Any]) -> str:
    s = e.get("serving")
    return "all tokens" if s is None else f"{s['sink_tokens']} / {s['recent_window']} / {s['page_size']}"


def _entry_bits(e: dict[str, Any]) -> str:
    b = e.get("bits")
    return "model dtype" if b is None else f"{b['key']:.3g} / {b['value']:.3g}"


def task_table(served: dict[str, Any]) -> list[tuple[str, str, dict[str, float]]]:
    """(task, primary metric, {entry: value}) for every task the report holds."""
    tasks = served.get("tasks") or {}
    scores = tasks.get("scores") or {}
    ref = scores.get(served["reference"], {})
    rows = []
    for task in sorted(ref):
        key = primary_metric(ref[task])
        rows.append((task, key, {name: per[task][key] for name, per in scores.items() if key in per.get(task, {})}))
    return rows


def served_markdown(report: dict[str, Any]) -> list[str]:
    """Markdown lines: entries with bytes per token and evaluation KL, task accuracy, passkey accuracy."""
    served = report["served"]
    kl = {r["name"]: eval_kl(r) for r in report["bundles"]}
    entries = served["entries"]
    model = served.get("model") or {}
    lines = ["", "## Served through the cache", ""]
    note = f"Loop steps {model.get('loop_steps')}"
    if "recurrences" in model:
        note += f"; Huginn recurrences {model['recurrences']}, initial state {model['initial_state']}"
    lines += [
        note + ". Bytes per token: the cache's stored tensors after prefilling "
        f"{entries[0]['bytes']['tokens']} held-out tokens, divided by the tokens.",
        "",
    ]
    lines += [
        "| entry | kind | bits K / V | sinks / window / page | bytes per token | encoded bytes per token "
        "| ratio to bf16 | evaluation KL |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        b = e["bytes"]
        lines.append(
            f"| {e['name']} | {e['kind']} | {_entry_bits(e)} | {_serving(e)} | {b['bytes_per_token']:.1f} | "
            f"{_fmt(b['encoded_bytes_per_token'], '.1f')} | {b['ratio_to_bf16']:.4f} | "
            f"{_fmt(kl.get(e['name']), '.5f') if e['kind'] != 'full-precision' else '0'} |"
        )
    names = [e["name"] for e in entries]
    tasks = task_table(served)
    if tasks:
        drops = served.get("accuracy_drop") or {}
        lines += [
            "",
            "### Task accuracy (lm-eval, greedy)",
            "",
            "| task | metric | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for task, key, values in tasks:
            cells = []
            for n in names:
                drop = drops.get(n, {}).get(task)
                cells.append(_fmt(values.get(n), ".4f") + (f" ({-drop:+.4f})" if drop else ""))
            lines.append(f"| {task} | {key} | " + " | ".join(cells) + " |")
        limit = served["tasks"].get("limit")
        samples = ", ".join(f"{t}: {n}" for t, n in (served["tasks"].get("samples") or {}).items())
        lines += [
            "",
            f"Samples per task: {samples or 'n/a'}"
            + (f" (--limit {limit:g})" if limit else "")
            + "; in brackets: the change against "
            + served["reference"]
            + ".",
            "",
            "Mean task accuracy against encoded bytes per token (full precision: its cache's bytes per token), "
            "one point per entry: `accuracy_vs_bytes.png`.",
        ]
    pk = served.get("passkey")
    if pk:
        lens = [str(n) for n in pk["lengths"]]
        lines += [
            "",
            f"### Passkey retrieval ({pk['trials_per_length']} trials per length, accuracy)",
            "",
            "| entry | " + " | ".join(f"{n} tokens" for n in lens) + " |",
            "|---|" + "---|" * len(lens),
        ]
        for n in names:
            lines.append(f"| {n} | " + " | ".join(_fmt(pk["accuracy"][n][k], ".2f") for k in lens) + " |")
    return lines


def _served_accuracy(plt: Any, served: dict[str, Any]) -> Any:
    """Grouped bars, one group per task (primary metric) and passkey length, one bar per entry (full
    precision, bundles, baselines)."""
    names = [e["name"] for e in served["entries"]]
    groups = [(task, values) for task, _, values in task_table(served)]
    pk = served.get("passkey")
    if pk:
        groups += [(f"passkey {n}", {e: pk["accuracy"][e][str(n)] for e in names}) for n in pk["lengths"]]
    width = 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(groups) * max(len(names), 2) * 0.35 + 2), 3.8))
    for i, name in enumerate(names):
        xs = [g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [values.get(name, 0.0) for _, values in groups], width, label=name)
    ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=7)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("Accuracy through the served cache")
    ax.legend(fontsize=6, ncol=2)
    return fig


def accuracy_points(served: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(bytes per token, mean task accuracy, entry) per entry with task scores: encoded bytes per token (full
    precision: its cache's bytes per token) and the mean over the report's tasks of their primary metrics."""
    tasks = task_table(served)
    points = []
    for e in served["entries"]:
        scores = [values[e["name"]] for _, _, values in tasks if e["name"] in values]
        size = e["bytes"]["encoded_bytes_per_token"]
        if scores:
            points.append(
                (e["bytes"]["bytes_per_token"] if size is None else size, sum(scores) / len(scores), e["name"])
            )
    return points


def _accuracy_vs_bytes(plt: Any, points: list[tuple[float, float, str]]) -> Any:
    """The front a user chooses from: one labelled point per entry, bytes per token on a log axis; the labels of
    points at the same place are stacked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=18)
    seen: dict[tuple[float, float], int] = {}
    for x, y, name in points:
        k = seen[x, y] = seen.get((x, y), -1) + 1
        ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3 + 7 * k), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("encoded bytes per token (full precision: its cache)")
    ax.set_ylabel("task accuracy (mean over tasks)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Task accuracy against bytes per token")
    return fig
