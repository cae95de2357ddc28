"""The figures of docs/quality.md (docs/figures/), drawn from the stored results of
`benchmarks/reproduction/reproduce.py` (benchmarks/results/results.json); `benchmarks/reproduction/reproduce.py
--report-only` calls it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.reproduction.reproduce_tables import METHODS, NAMES, WIDTHS


def draw(data: dict, figs: Path) -> None:
    """structure.png, nmse.png, per_step_kl.png and finetune_curves.png of docs/quality.md into ``figs``."""
    figs.mkdir(parents=True, exist_ok=True)
    m, s = data["metrics"], data["structure"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind in ("key", "value"):
        ax.plot([1, 2, 3], s[kind]["adjacent_steps"], marker="o", label=f"{kind}s: same channel, adjacent steps")
        ax.axhline(
            s[kind]["within_group"],
            ls="--",
            color="C0" if kind == "key" else "C1",
            label=f"{kind}s: other channels, one group",
        )
    ax.set_xticks([1, 2, 3], ["1-2", "2-3", "3-4"])
    ax.set(xlabel="loop steps", ylabel="mean |r|", ylim=(0, 1), title="Inter-step structure (reference model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figs / "structure.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, bits in zip(axes, WIDTHS):
        labels, values = [], []
        for weighted in (False, True):
            for method in ("cq", "loopvq"):
                labels.append(f"{'CQ' if method == 'cq' else 'loop'}\n{'Fisher' if weighted else 'plain'}")
                values.append(m[f"{method}-{bits}{'' if weighted else '-plain'}/kmeans"]["nmse"]["key"])
        ax.bar(labels, values, color=["C0", "C1", "C0", "C1"])
        ax.set(title=f"key NMSE at {bits:g} bit", ylabel="NMSE (held-out)")
    fig.tight_layout()
    fig.savefig(figs / "nmse.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
    for ax, bits in zip(axes, WIDTHS):
        for method in METHODS:
            ax.plot([1, 2, 3, 4], m[f"{method}-{bits}/finetune"]["per_step_kl"], marker="o", label=NAMES[method])
        ax.set(
            title=f"KL, one loop step quantized, {bits:g} bit",
            xlabel="quantized step",
            ylabel="held-out KL",
            yscale="log",
            xticks=[1, 2, 3, 4],
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figs / "per_step_kl.png", dpi=120)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, bits in zip(axes, WIDTHS):
        for method in METHODS:
            c = data["curves"][f"{method}-{bits}"]["curve"]
            ax.plot([e["step"] for e in c], [e["selection_kl"] for e in c], marker="o", label=NAMES[method])
        ax.set(
            title=f"Fine-tuning, {bits:g} bit",
            xlabel="optimizer step (0 = k-means)",
            ylabel="selection KL",
            yscale="log",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figs / "finetune_curves.png", dpi=120)
    plt.close("all")
