"""The printed tables of benchmarks/decode/bench_decode_model.py (after a run, and from a saved result with
``--table-from``): the cases as markdown against bf16, and each case against the tokens/s bench_decode.py models."""

from __future__ import annotations

from typing import Any


def against_model(result: dict[str, Any]) -> list[str]:
    """One line per measured case with a kernel-modelled figure: tokens/s, the figure, their ratio."""
    lines = []
    for r in result["cases"]:
        if r["status"] == "ok" and "modelled_tokens_per_s" in r:
            ratio = r["tokens_per_s"] / r["modelled_tokens_per_s"]
            lines.append(
                f"{r['context']} x {r['batch']} {r['cache']}: {r['tokens_per_s']:.1f} tokens/s, "
                f"{ratio:.0%} of the kernel-modelled {r['modelled_tokens_per_s']:.1f}"
            )
    return lines


def table(result: dict[str, Any]) -> str:
    """Markdown table of the cases: ms per step, tokens/s and speedup over bf16 at the same (context, batch)."""
    bf16 = {(r["context"], r["batch"]): r for r in result["cases"] if r["cache"] == "bf16" and r["status"] == "ok"}
    rows = [
        "| context | batch | cache | median ms/step | mean ms/step | tokens/s | speedup vs bf16 | peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        head = f"| {r['context']} | {r['batch']} | {r['cache']} |"
        if r["status"] != "ok":
            need = f", needs {r['bf16_bytes'] / 1e9:.1f} GB" if "bf16_bytes" in r else ""
            free = f", {r['free_bytes'] / 1e9:.1f} GB free" if "free_bytes" in r else ""
            rows.append(f"{head} {r['status']}{need}{free} | | | | |")
            continue
        ref = bf16.get((r["context"], r["batch"]))
        speedup = f"{ref['mean_ms'] / r['mean_ms']:.2f}" if ref is not None and r["cache"] != "bf16" else ""
        peak = f"{r['peak_bytes'] / 1e9:.1f}" if "peak_bytes" in r else ""
        rows.append(
            f"{head} {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['tokens_per_s']:.1f} | {speedup} | {peak} |"
        )
    return "\n".join(rows)
