"""benchmarks/quality/quality_table.py: docs/quality-models.md, one quality table per shipped reference model from
`benchmarks/quality/eval_reference.py`'s stored results (benchmarks/results/eval-reference-<model>/: report.json and
setup.json), with whether the paper's ordering of the methods holds in task accuracy and the paper's numbers on
real models beside it. A model without stored results reads "not measured yet".

    python benchmarks/quality/quality_table.py      # rewrite docs/quality-models.md from the stored results
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

from benchmarks.common.markdown import md_table, recipe, wrap
from benchmarks.common.paths import RESULTS, ROOT
from benchmarks.quality.reference_models import GROUP_SIZES, MODELS as MODELS_TABLE, SHIPPED_MODELS
from loopvq_calib.evaluation.report import accuracy_points

PAGE = ROOT / "docs" / "quality-models.md"
MODELS = SHIPPED_MODELS
FOLDERS = {name: MODELS_TABLE[name].folder for name in MODELS}
ORDER = ("cq", "tasq", "loopvq", "tasq+loopvq")  # the paper's ordering in accuracy, lowest first
ROWS = (*ORDER, "tasq+loopvq-channels")  # the table's order of eval_reference.py's methods
NAMES = {
    "cq": "CQ",
    "tasq": "TaSQ",
    "loopvq": "LoopVQ",
    "tasq+loopvq": "TaSQ+LoopVQ",
    "tasq+loopvq-channels": "TaSQ+LoopVQ (channels)",
    "last-step-kv": "last-step KV",
    "kivi2": "KIVI 2-bit",
    "kivi4": "KIVI 4-bit",
    "fp8": "fp8",
}
WIDTHS = tuple(GROUP_SIZES)
# arXiv:2611.05304 Table 2 (docs/method.md): average accuracy (%) of GSM8K, MATH500, HumanEval and MBPP
PAPER = {
    "ouro": ("Ouro-1.4B", 75.7, {0.5: (32.3, 43.6, 68.3, 73.6), 0.25: (28.2, 29.6, 45.1, 62.3)}),
    "huginn": ("Huginn-3.5B", 25.0, {0.5: (13.7, 14.8, 22.4, 23.5), 0.25: (12.9, 13.0, 18.6, 21.0)}),
}


def load(model: str, results: Path = RESULTS) -> dict[str, Any] | None:
    """The stored report.json and setup.json of ``model``, or None when either is missing."""
    folder = results / f"eval-reference-{model}"
    if not ((folder / "report.json").is_file() and (folder / "setup.json").is_file()):
        return None
    return {
        "report": json.loads((folder / "report.json").read_text()),
        "setup": json.loads((folder / "setup.json").read_text()),
        "folder": folder,
    }


def accuracies(result: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Entry name -> (bytes per token, mean task accuracy): the points of loopvq-eval's accuracy_vs_bytes.png."""
    return {name: (size, acc) for size, acc, name in accuracy_points(result["report"]["served"])}


def rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per entry: full precision, each bundle (width, method, fine-tuned then k-means only), the
    baselines; columns as :func:`header`."""
    report, setup = result["report"], result["setup"]
    served = report["served"]
    quality = {b["name"]: b for b in report["bundles"]}
    front = accuracies(result)
    passkey = served.get("passkey") or {"lengths": [], "accuracy": {}}
    entries = {e["name"]: e for e in served["entries"]}
    order = [served["reference"]] + [
        b["name"]
        for b in sorted(setup["bundles"], key=lambda b: (-b["width"], ROWS.index(b["method"]), not b["finetuned"]))
    ]
    order += [e["name"] for e in served["entries"] if e["kind"] == "baseline"]
    about = {b["name"]: b for b in setup["bundles"]}
    out = []
    for name in order:
        e, q = entries[name], quality.get(name)
        bits = e["bits"]
        tuned = about.get(name, {}).get("finetuned")
        method = NAMES.get(about.get(name, e)["method"], name) if e["kind"] != "full-precision" else name
        ppl = next(iter(quality.values()))["ppl_fp"] if q is None else q["ppl_quantized"]
        size, acc = front.get(name, (None, None))
        out.append(
            [
                method,
                "16 / 16" if bits is None else f"{bits['key']:.3g} / {bits['value']:.3g}",
                "" if tuned is None else ("yes" if tuned else "no"),
                "0" if q is None else f"{q['eval_kl']:.4f}",
                f"{ppl:.2f}",
                "n/a" if acc is None else f"{acc:.3f}",
                " / ".join(f"{passkey['accuracy'][name][str(n)]:.2f}" for n in passkey["lengths"]) or "n/a",
                "n/a" if size is None else f"{size:.0f}",
            ]
        )
    return out


def header(result: dict[str, Any]) -> list[str]:
    lengths = (result["report"]["served"].get("passkey") or {}).get("lengths", [])
    return [
        "method",
        "bits K / V",
        "fine-tuned",
        "evaluation KL",
        "perplexity",
        "task accuracy",
        "passkey " + " / ".join(str(n) for n in lengths),
        "bytes per token",
    ]


def chain(values: dict[str, float]) -> str:
    """``CQ 0.100 < TaSQ 0.200 = ...``: the methods in the paper's order with the relation of each neighbour pair."""
    text = f"{NAMES[ORDER[0]]} {values[ORDER[0]]:.3f}"
    for low, high in itertools.pairwise(ORDER):
        a, b = values[low], values[high]
        text += f" {'<' if a < b else '=' if a == b else '>'} {NAMES[high]} {b:.3f}"
    return text


def ordering(values: dict[str, float]) -> str:
    """Whether the paper's ordering (CQ < TaSQ < LoopVQ < TaSQ+LoopVQ) holds in ``values`` (method -> accuracy):
    "holds", "holds with ties", "all equal" or "does not hold", with the chain."""
    pairs = [(values[a], values[b]) for a, b in itertools.pairwise(ORDER)]
    if all(a < b for a, b in pairs):
        verdict = "holds"
    elif all(a == b for a, b in pairs):
        verdict = "all equal"
    elif all(a <= b for a, b in pairs):
        verdict = "holds with ties"
    else:
        verdict = "does not hold"
    return f"{verdict} ({chain(values)})"


def ordering_line(result: dict[str, Any]) -> str:
    """The paper's ordering in task accuracy at each width, fine-tuned and k-means only."""
    front = accuracies(result)
    parts = []
    for finetuned in (True, False):
        for width in WIDTHS:
            acc = {
                b["method"]: front[b["name"]][1]
                for b in result["setup"]["bundles"]
                if b["width"] == width and b["finetuned"] == finetuned and b["name"] in front
            }
            if set(ORDER) <= set(acc):
                parts.append(f"{width:g} bit {'fine-tuned' if finetuned else 'k-means only'}: {ordering(acc)}")
    return (
        "The paper's ordering in task accuracy, CQ < TaSQ < LoopVQ < TaSQ+LoopVQ: "
        + ("; ".join(parts) if parts else "not measured (a method or width is missing)")
        + "."
    )


def paper_line(model: str) -> str:
    """The paper's numbers on its real model of the same architecture (docs/method.md)."""
    name, bf16, acc = PAPER[model]
    widths = "; ".join(f"{w:g} bit " + " / ".join(f"{NAMES[m]} {v:.1f}" for m, v in zip(ORDER, acc[w])) for w in WIDTHS)
    return (
        f"The paper on {name} (Table 2, average accuracy in % of GSM8K, MATH500, HumanEval and MBPP): BF16 "
        f"{bf16:.1f}; {widths}."
    )


def setup_line(result: dict[str, Any]) -> str:
    """How the table was measured: calibration, serving, evaluation, the command and the commit."""
    report, setup = result["report"], result["setup"]
    cal, data, served = setup["calibration"], report["data"], report["served"]
    widths = ", ".join(f"G {g} at {b} bit" for b, g in cal["group_size"].items())
    pk = served.get("passkey")
    trials = pk["trials_per_length"] if pk else 0
    keys = f"passkey: {trials} trial{'' if trials == 1 else 's'} per length" if pk else "no passkey"
    limit = served["tasks"]["limit"]
    items = f"items 1 to {limit:g}" if limit else "all items"
    secs = setup.get("seconds", {})
    where = f"{setup['cpu_count']} CPU cores" if setup.get("device", "cpu") == "cpu" else setup["device"]
    took = (
        f" (calibration {secs['calibration'] / 60:.1f} min, loopvq-eval {secs['loopvq-eval'] / 60:.1f} min)"
        if {"calibration", "loopvq-eval"} <= set(secs)
        else ""
    )
    return wrap(
        f"*Setup: calibration {cal['sequences']} x {cal['sequence_length']} tokens of `{cal['dataset']}` "
        f"(K {cal['codebook_size']}, {widths}, T_c {cal['steps_per_block']}), k-means "
        f"{cal['kmeans_iterations']} iterations, then either fine-tuning ({recipe(cal['finetune'])}) or none "
        f"(k-means only); served with {cal['sink_tokens']} sinks, a {cal['serving']['recent_window']}-token "
        f"{report['dtype']} window and pages of {cal['serving']['page_size']}; evaluation KL and perplexity "
        f"on {data['num_sequences']} x {data['sequence_length']} tokens of `{setup['heldout']}`; task "
        f"accuracy: {items} of `{', '.join(served['tasks']['tasks'])}` (mean of each task's first metric); "
        f"{keys}; bytes per token: the encoded bytes of one token (full precision: its cache's bytes per "
        f"token) after a {data['sequence_length']}-token prefill. At commit `{setup['commit']}` on "
        f"{where}{took}, raw results in `{shown(result['folder'])}/`:*"
    )


def shown(path: Path) -> str:
    """``path`` relative to the repository (as given when outside it)."""
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def model_section(model: str, result: dict[str, Any] | None, *, page_dir: Path) -> str:
    """One model's heading, setup, table, ordering line, the paper's numbers and the front's plot (linked from
    ``page_dir``)."""
    head = f"## `{FOLDERS[model]}`"
    if result is None:
        commands = (
            f"python benchmarks/quality/eval_reference.py --model {model}\npython benchmarks/quality/quality_table.py"
        )
        return "\n\n".join(
            [
                head,
                "Not measured yet. These commands measure it and rewrite this page:",
                f"```bash\n{commands}\n```",
                wrap(paper_line(model)),
            ]
        )
    parts = [
        head,
        setup_line(result),
        f"```bash\n{result['setup']['command']}\n```",
        md_table(header(result), rows(result)),
        wrap(ordering_line(result)),
        wrap(paper_line(model)),
    ]
    figure = result["folder"] / "accuracy_vs_bytes.png"
    if figure.is_file():
        parts.append(
            f"![{model}: task accuracy against bytes per token]({Path(os.path.relpath(figure, page_dir)).as_posix()})"
        )
    return "\n\n".join(parts)


def render(results: dict[str, dict[str, Any] | None], *, page_dir: Path = PAGE.parent) -> str:
    """The whole page (in ``page_dir``) from each model's stored results (None: not measured yet)."""
    intro = wrap(
        "**10 M-parameter reference models** (docs/reference-model.md), not real Ouro or Huginn "
        "checkpoints: their absolute numbers do not transfer to real models, so compare numbers within a "
        "model's table. Each table comes from one `loopvq-eval` run over every method at 0.5 and 0.25 bit, "
        "fine-tuned and k-means only, the baselines and full precision; the figure under it is that run's "
        "`accuracy_vs_bytes.png`, the front a user chooses from. The paper's numbers on the real model of "
        "the same architecture stand beside each ordering line; they come from other tasks at another scale."
    )
    sections = [model_section(m, results.get(m), page_dir=page_dir) for m in MODELS]
    return (
        "\n\n".join(
            [
                "# Quality across the reference models",
                "<!-- Generated by `python benchmarks/quality/quality_table.py`; do not edit. -->",
                intro,
                *sections,
            ]
        )
        + "\n"
    )


def write_page(path: Path = PAGE, *, results: Path = RESULTS) -> None:
    """Write the page at ``path`` from the results stored under ``results``."""
    path.write_text(render({m: load(m, results) for m in MODELS}, page_dir=path.parent))


if __name__ == "__main__":
    write_page()
    print(f"written from {RESULTS.relative_to(ROOT)}/eval-reference-<model>/: {PAGE.relative_to(ROOT)}")
