"""The printed tables of benchmarks/decode/bench_decode.py (after a run, and from a saved result with ``--table-from``):
the launch variants and the cases as markdown, each TaSQ method against LoopVQ, the time that does not grow with the
context, and how many long sequences one card holds."""

from __future__ import annotations

import itertools

from benchmarks.decode.bench_decode_shapes import KV_HEADS, SINKS, SITES, T_C, WINDOW, D, K


def table(result: dict) -> str:
    """Markdown tables of the launch variants and the cases (what docs/decode-speed.md shows)."""
    rows = ["| variant | method | coded ms | bf16 SDPA ms | speedup |", "|---|---|---|---|---|"]
    for r in result["launches"]:
        rows.append(
            f"| {r['variant']} | {r['method']} | {r['coded_ms']:.4f} | {r['bf16_ms']:.4f} | "
            f"{r['bf16_ms'] / r['coded_ms']:.2f} |"
        )
    if not result["cases"]:
        return "\n".join(rows)
    rows += [
        "",
        (
            "| context | batch | method | bf16 SDPA ms | coded ms | speedup | bf16 GB/s | coded GB/s | "
            "tokens/s bf16 | tokens/s coded |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        rows.append(
            f"| {r['context']} | {r['batch']} | {r['method']} | {r['bf16_ms']:.4f} | {r['coded_ms']:.4f} | "
            f"{r['speedup']:.2f} | {r['bf16_GBps']:.0f} | {r['coded_GBps']:.0f} | "
            f"{r['bf16_tokens_per_s']:.1f} | {r['coded_tokens_per_s']:.1f} |"
        )
    return "\n".join(rows)


def against_loopvq(result: dict) -> str:
    """Per (context, batch): each TaSQ method's speed-up over bf16 SDPA and its time over LoopVQ's."""
    cases = {(r["context"], r["batch"], r["method"]): r for r in result["cases"]}
    lines = []
    for (context, batch, method), r in sorted(cases.items()):
        loopvq = cases.get((context, batch, "loopvq"))
        if method != "loopvq" and loopvq is not None:
            lines.append(
                f"{context} x {batch} {method}: {r['speedup']:.2f}x bf16 SDPA (LoopVQ "
                f"{loopvq['speedup']:.2f}x), time {r['coded_ms'] / loopvq['coded_ms'] - 1:+.1%} over LoopVQ's"
            )
    return "\n".join(lines)


def fixed_cost(result: dict, batch: int = 8, method: str = "loopvq") -> str:
    """Straight lines time = intercept + slope x context through each pair of successive contexts (and a least-
    squares line through all) of one (batch, method): how much of the time does not grow with the context."""
    pts = sorted(
        (r["context"], r["coded_ms"] * 1e3) for r in result["cases"] if r["batch"] == batch and r["method"] == method
    )
    lines = [f"{method}, batch {batch}: coded us at contexts " + ", ".join(f"{c}: {t:.1f}" for c, t in pts)]
    for (c0, t0), (c1, t1) in itertools.pairwise(pts):
        slope = (t1 - t0) / (c1 - c0)
        pred = ", ".join(f"{c}: {t0 + slope * (c - c0):.1f}" for c, _ in pts if c not in (c0, c1))
        lines.append(
            f"  line through {c0} and {c1}: {t0 - slope * c0:.1f} us + {slope * 1e3:.2f} us per 1,000 tokens;"
            f" predicts {pred}"
        )
    n = len(pts)
    mc, mt = sum(c for c, _ in pts) / n, sum(t for _, t in pts) / n
    slope = sum((c - mc) * (t - mt) for c, t in pts) / sum((c - mc) ** 2 for c, _ in pts)
    lines.append(f"  least squares over all {n}: {mt - slope * mc:.1f} us + {slope * 1e3:.2f} us per 1,000 tokens")
    return "\n".join(lines)


def sequences_that_fit(result: dict, context: int = 65536) -> str:
    """Sequences of ``context`` tokens one card holds at bench_decode's accounting (codes once, fp16 step tables
    once, each sequence's sinks/window in bf16) and at the shipped cache's (``serving.cache``, LoopVQ / TaSQ+LoopVQ):
    codes twice (the page list and the kernel's code buffer, which holds 1x to 2x the tokens it needs: it doubles
    when full), int64 positions per site (1x to 2x: they double too), step tables twice (the step tables and the
    kernel's lane-order copy) plus the fp32 key table for free TaSQ+LoopVQ's fp32-key launch (channels layouts
    launch with fp16 keys, as LoopVQ does)."""
    fit = result["fits_batch1"]
    spare = fit["total_bytes"] - fit["weight_bytes"] - 2 * 2**30
    bf16_token = SITES * 2 * KV_HEADS * D * 2
    code_token = SITES // T_C * 2 * KV_HEADS * 32
    tables = SITES * 2 * KV_HEADS * K * D * 2
    fp_tokens = SINKS + WINDOW
    coded = context - fp_tokens
    lines = [
        (
            f"at {context} tokens: bf16 cache {spare // (context * bf16_token)} sequences; "
            f"one sequence's bf16 sinks/window {fp_tokens * bf16_token / 1e6:.1f} MB, "
            f"codes {coded * code_token / 1e9:.3f} GB"
        )
    ]
    once = coded * code_token + fp_tokens * bf16_token
    lines.append(f"  codes once, tables once ({tables / 1e6:.0f} MB): {(spare - tables) // once} sequences")
    for name, copies in (("loopvq", 2), ("tasq+loopvq", 3), ("tasq+loopvq-channels", 2)):
        for slack in (1, 2):  # code buffer and position storage exactly full, or just doubled
            per_seq = coded * code_token * (1 + slack) + context * SITES * 8 * slack + fp_tokens * bf16_token
            lines.append(
                f"  shipped cache, {name}: tables {copies * tables / 1e6:.0f} MB, buffers {slack}x: "
                f"{(spare - copies * tables) // per_seq} sequences"
            )
    return "\n".join(lines)
