"""The served-cache part of the ``loopvq-eval`` report: markdown tables and one plot (served_accuracy.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import _fmt, eval_kl
from .served import primary_metric


def _serving(e: dict[str, Any]) -> str:
    s = e.get("serving")
    return "all tokens" if s is None else f"{s['sink_tokens']} / {s['recent_window']} / {s['page_size']}"


def _bits(e: dict[str, Any]) -> str:
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
    lines += [note + ". Bytes per token: the cache's stored tensors after prefilling "
              f"{entries[0]['bytes']['tokens']} held-out tokens, divided by the tokens.", ""]
    lines += ["| entry | kind | bits K / V | sinks / window / page | bytes per token | encoded bytes per token "
              "| ratio to bf16 | evaluation KL |", "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        b = e["bytes"]
        lines.append(f"| {e['name']} | {e['kind']} | {_bits(e)} | {_serving(e)} | {b['bytes_per_token']:.1f} | "
                     f"{_fmt(b['encoded_bytes_per_token'], '.1f')} | {b['ratio_to_bf16']:.4f} | "
                     f"{_fmt(kl.get(e['name']), '.5f') if e['kind'] != 'full-precision' else '0'} |")
    names = [e["name"] for e in entries]
    tasks = task_table(served)
    if tasks:
        drops = served.get("accuracy_drop") or {}
        lines += ["", "### Task accuracy (lm-eval, greedy)", "",
                  "| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for task, key, values in tasks:
            cells = []
            for n in names:
                drop = drops.get(n, {}).get(task)
                cells.append(_fmt(values.get(n), ".4f") + (f" ({-drop:+.4f})" if drop else ""))
            lines.append(f"| {task} | {key} | " + " | ".join(cells) + " |")
        limit = served["tasks"].get("limit")
        samples = ", ".join(f"{t}: {n}" for t, n in (served["tasks"].get("samples") or {}).items())
        lines += ["", f"Samples per task: {samples or 'n/a'}" + (f" (--limit {limit:g})" if limit else "")
                  + "; in brackets: the change against " + served["reference"] + "."]
    pk = served.get("passkey")
    if pk:
        lens = [str(n) for n in pk["lengths"]]
        lines += ["", f"### Passkey retrieval ({pk['trials_per_length']} trials per length, accuracy)", "",
                  "| entry | " + " | ".join(f"{n} tokens" for n in lens) + " |", "|---|" + "---|" * len(lens)]
        for n in names:
            lines.append(f"| {n} | " + " | ".join(_fmt(pk["accuracy"][n][k], ".2f") for k in lens) + " |")
    return lines


def served_plot(served: dict[str, Any], out_dir: Path) -> Path:
    """served_accuracy.png: grouped bars, one group per task (primary metric) and passkey length, one bar
    per entry (full precision, bundles, baselines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path = out_dir / "served_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
