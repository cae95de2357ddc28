"""The tables of docs/quality.md from `benchmarks/reproduction/reproduce.py`'s stored results
(benchmarks/results/results.json): the study's methods and widths, and one markdown table per section (inter-step
structure, k-means error, methods, ablation, per-step sensitivity, calibration size and corpus, fine-tuning curves).
benchmarks/reproduction/reproduce_report.py sets them in the page with their setups and words."""

from __future__ import annotations

from benchmarks.common.markdown import md_table

METHODS = ("cq", "tasq", "loopvq", "tasq+loopvq")
NAMES = {"cq": "CQ", "tasq": "TaSQ", "loopvq": "LoopVQ", "tasq+loopvq": "TaSQ+LoopVQ"}
WIDTHS = (0.5, 0.25)


def _f(v: float, spec: str = ".4f") -> str:
    return format(v, spec)


def structure_section(s: dict) -> str:
    rows = [
        [kind + "s"]
        + [_f(v, ".3f") for v in s[kind]["adjacent_steps"]]
        + [_f(s[kind]["adjacent_mean"], ".3f"), _f(s[kind]["within_group"], ".3f")]
        for kind in ("key", "value")
    ]
    rows.append(["paper, Ouro-1.4B keys", "0.69", "", "0.94", "0.85", "0.16"])
    head = ["", "steps 1-2", "steps 2-3", "steps 3-4", "adjacent mean", "other channels, one 16-channel group"]
    return md_table(head, rows)


def nmse_section(m: dict) -> str:
    rows = []
    for bits in WIDTHS:
        for weighted in (False, True):
            for method in ("cq", "loopvq"):
                r = m[f"{method}-{bits}{'' if weighted else '-plain'}/kmeans"]
                rows.append(
                    [
                        f"{bits:g}",
                        "Fisher" if weighted else "plain",
                        "per-step (CQ)" if method == "cq" else "loop-axis",
                        *(_f(v) for v in r["nmse_per_step"]["key"]),
                        _f(r["nmse"]["key"]),
                        _f(r["nmse"]["value"]),
                    ]
                )
    return md_table(
        ["bits", "k-means", "groups", "key NMSE step 1", "step 2", "step 3", "step 4", "key NMSE", "value NMSE"], rows
    )


def method_section(m: dict) -> str:
    rows = []
    for bits in WIDTHS:
        for method in METHODS:
            r = m[f"{method}-{bits}/finetune"]
            rows.append(
                [
                    NAMES[method],
                    f"{bits:g}",
                    f"{r['bits']['key']:.3f} / {r['bits']['value']:.3f}",
                    _f(m[f"{method}-{bits}/kmeans"]["eval_kl"]),
                    _f(r["eval_kl"]),
                    _f(r["ppl_fp"], ".2f"),
                    _f(r["ppl_quantized"], ".2f"),
                    f"{100 * r['ppl_increase']:+.1f}%",
                ]
            )
    return md_table(
        ["method", "width", "bits key / value", "KL k-means", "KL fine-tuned", "ppl fp", "ppl quantized", "ppl change"],
        rows,
    )


def ablation_section(m: dict) -> str:
    rows = []
    for bits in WIDTHS:
        for base, coupled in (("cq", "loopvq"), ("tasq", "tasq+loopvq")):
            cells = [
                m[f"{name}-{bits}/{stage}"]["eval_kl"] for name in (base, coupled) for stage in ("kmeans", "finetune")
            ]
            rows.append([NAMES[base], f"{bits:g}", *(_f(v) for v in cells)])
    return md_table(
        ["base", "width", "plain", "+ fine-tuning", "+ coupling (loop axis)", "+ coupling + fine-tuning"], rows
    )


def step_section(m: dict) -> str:
    rows = []
    for bits in WIDTHS:
        for method in METHODS:
            r = m[f"{method}-{bits}/finetune"]
            rows.append([NAMES[method], f"{bits:g}", *(_f(v) for v in r["per_step_kl"]), _f(r["eval_kl"])])
    rows.append(["paper Ouro-1.4B (Table 1)", "0.5", "0.069", "0.018", "0.013", "0.030", ""])
    rows.append(["paper Ouro-1.4B (Table 1)", "0.25", "0.123", "0.029", "0.026", "0.065", ""])
    head = ["method", "width", "KL step 1 only", "step 2 only", "step 3 only", "step 4 only", "all steps"]
    return md_table(head, rows)


def size_corpus_section(m: dict) -> str:
    rows = [
        [f"LoopVQ 0.25, {n} sequences", _f(m[f"{name}/kmeans"]["eval_kl"]), _f(m[f"{name}/finetune"]["eval_kl"])]
        for n, name in ((8, "loopvq-0.25-n8"), (16, "loopvq-0.25"), (32, "loopvq-0.25-n32"))
    ]
    for method in ("cq", "tasq+loopvq"):
        for corpus, name in (("Shakespeare", f"{method}-0.25"), ("KJV", f"{method}-0.25-kjv")):
            rows.append(
                [
                    f"{NAMES[method]} 0.25, calibrated on {corpus}",
                    _f(m[f"{name}/kmeans"]["eval_kl"]),
                    _f(m[f"{name}/finetune"]["eval_kl"]),
                ]
            )
    return md_table(["run", "held-out KL k-means", "held-out KL fine-tuned"], rows)


def kept(curve: dict) -> dict:
    """The curve point whose codebooks the run kept."""
    return next(e for e in curve["curve"] if e["step"] == curve["best_step"])


def curve_section(curves: dict, m: dict) -> str:
    rows = []
    for bits in WIDTHS:
        for method in METHODS:
            name, c = f"{method}-{bits}", curves[f"{method}-{bits}"]
            sel0, sel = c["curve"][0]["selection_kl"], kept(c)["selection_kl"]
            ev0, ev = m[f"{name}/kmeans"]["eval_kl"], m[f"{name}/finetune"]["eval_kl"]
            rows.append(
                [
                    NAMES[method],
                    f"{bits:g}",
                    _f(sel0),
                    f"{c['best_step']} of {c['curve'][-1]['step']}",
                    _f(sel),
                    f"{100 * (sel / sel0 - 1):+.1f}%",
                    _f(ev0),
                    _f(ev),
                    f"{100 * (ev / ev0 - 1):+.1f}%",
                ]
            )
    return md_table(
        [
            "method",
            "width",
            "selection KL, k-means",
            "kept step",
            "selection KL, kept",
            "change",
            "evaluation KL, k-means",
            "evaluation KL, fine-tuned",
            "change",
        ],
        rows,
    )
