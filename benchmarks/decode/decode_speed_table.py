"""docs/decode-speed.md, generated from the stored output of `benchmarks/decode/bench_decode.py` and
`benchmarks/decode/bench_decode_model.py`.

The page: one KV site's decode attention from the coded cache against bf16 SDPA over an uncompressed cache, per
method over the (context, batch) grid of ``--kernel``; whole-model decode tokens/s through the served cache against
the model's own bf16 cache, from ``--model``; where ``--graph`` exists, the same steps replayed from CUDA graphs
against eager ones and the kernel-modelled figure, with what its profile says limits them; the per-site and logits
checks of ``--checks``. Each with the machine, the command that reproduces it and the commit measured.

    python benchmarks/decode/decode_speed_table.py                           # print the page
    python benchmarks/decode/decode_speed_table.py --write docs/decode-speed.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

from benchmarks.common.markdown import wrap
from benchmarks.common.paths import RESULTS

KERNEL = RESULTS / "bench-decode-cuda-h200-run7.json"  # the decode kernel as it ships (run 7)
MODEL = RESULTS / "bench-decode-model-h200.json"
CHECKS = RESULTS / "bench-decode-model-checks-h200.json"
GRAPH = RESULTS / "bench-decode-model-h100-32k-b739aaa.json"  # bench_decode_model.py's eager and -graph cases
LATEST = RESULTS / "bench-decode-h100-32k-b8-b739aaa.json"  # the kernel at 32k x 8 as the tree ships, re-measured
METHODS = {"loopvq": "LoopVQ", "tasq+loopvq": "TaSQ+LoopVQ", "tasq+loopvq-channels": "TaSQ+LoopVQ channels"}
GB = 1e9


def reproduce(result: dict[str, Any], path: Path) -> str:
    """The stored ``command`` as it runs from this tree: the script under benchmarks/decode/, ``--out`` the stored file,
    no ``--commit`` (the commit is the tree's own)."""
    words = result["command"].split()
    out, skip = [words[0], f"benchmarks/decode/{Path(words[1]).name}"], False
    for word, following in zip(words[2:], [*words[3:], ""]):
        if skip:
            skip = False
            continue
        if word in ("--out", "--commit"):
            out += ["--out", f"benchmarks/results/{path.name}"] if word == "--out" else []
            skip = bool(following)
            continue
        out.append(word)
    return " ".join(out)


def provenance(result: dict[str, Any], path: Path) -> str:
    return wrap(
        f"Measured on one {result['device']} (torch {result['torch']}) at commit `{result['commit']}`: "
        f"`{reproduce(result, path)}`."
    )


def attention_table(result: dict[str, Any]) -> list[str]:
    """(context, batch) -> bf16 SDPA and each method's microseconds and ratio, from bench_decode.py's ``cases``."""
    cases = {(r["context"], r["batch"], r["method"]): r for r in result["cases"]}
    grid = sorted({(context, batch) for context, batch, _ in cases})
    methods = [m for m in METHODS if any(key[2] == m for key in cases)]
    head = ["context", "batch", "bf16 SDPA us"] + [part for m in methods for part in (f"{METHODS[m]} us", "speedup")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, batch in grid:
        first = next(cases[(context, batch, m)] for m in methods if (context, batch, m) in cases)
        cells = [f"{context:,}", str(batch), f"{first['bf16_ms'] * 1e3:.1f}"]
        for m in methods:
            r = cases.get((context, batch, m))
            speedup = None if r is None else r["bf16_ms"] / r["coded_ms"]
            cells += ["-", "-"] if r is None else [f"{r['coded_ms'] * 1e3:.1f}", f"**{speedup:.2f}x**"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def model_table(result: dict[str, Any]) -> list[str]:
    """(context, batch) -> tokens/s of each cache, the coded caches' speed-up and every cache's peak memory, from
    bench_decode_model.py's ``cases``."""
    cases = {(r["context"], r["batch"], r["cache"]): r for r in result["cases"]}
    grid = sorted({(context, batch) for context, batch, _ in cases})
    methods = [m for m in METHODS if any(key[2] == m for key in cases)]
    head = [
        "context",
        "batch",
        "bf16 cache tokens/s",
        *(p for m in methods for p in (f"{METHODS[m]} tokens/s", "speedup")),
        "peak GB: bf16",
        *(METHODS[m] for m in methods),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, batch in grid:
        ref = cases.get((context, batch, "bf16"))
        cells, peaks = [f"{context:,}", str(batch), _tokens(ref)], [_peak(ref)]
        for m in methods:
            r = cases.get((context, batch, m))
            ok = r is not None and ref is not None and r["status"] == ref["status"] == "ok"
            cells += [_tokens(r), f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ok else "-"]
            peaks.append(_peak(r))
        lines.append("| " + " | ".join(cells + peaks) + " |")
    return lines


def _peak(case: dict[str, Any] | None) -> str:
    return "-" if case is None or "peak_bytes" not in case else f"{case['peak_bytes'] / GB:.1f}"


def _tokens(case: dict[str, Any] | None) -> str:
    if case is None:
        return "-"
    if case["status"] != "ok":
        need = f" (needs {case['bf16_bytes'] / GB:.0f} GB)" if "bf16_bytes" in case else ""
        return f"{case['status']}{need}"
    return f"{case['tokens_per_s']:.1f}"


def graph_table(result: dict[str, Any]) -> list[str]:
    """(context, batch) -> per cache (bf16 and each method) eager and graph tokens/s, and for each method the
    kernel-modelled figure and the graph's share of it, from bench_decode_model.py's -graph cases."""
    cases = {(r["context"], r["batch"], r["cache"]): r for r in result["cases"]}
    grid = sorted({(context, batch) for context, batch, _ in cases})
    names = {"bf16": "bf16", **METHODS}
    kinds = [k for k in names if any(c.removesuffix("-graph") == k for _, _, c in cases)]
    head = ["context", "batch"]
    for k in kinds:
        head += [f"{names[k]} eager", f"{names[k]} graph"] + ([] if k == "bf16" else ["modelled", "graph / modelled"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for context, batch in grid:
        cells = [f"{context:,}", str(batch)]
        for k in kinds:
            eager, graph = cases.get((context, batch, k)), cases.get((context, batch, f"{k}-graph"))
            cells += [_tokens(eager), _tokens(graph)]
            if k != "bf16":
                figure = (graph or eager or {}).get("modelled_tokens_per_s")
                ok = figure and graph is not None and graph["status"] == "ok"
                cells += [f"{figure:.1f}" if figure else "-", f"{graph['tokens_per_s'] / figure:.0%}" if ok else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def graph_limits(result: dict[str, Any]) -> list[str]:
    """What the profiled graph cases' steps spend: kernel time by kind against the replayed step's wall time."""
    lines = []
    for r in result["cases"]:
        if "profile" not in r:
            continue
        replayed, eager = r["profile"]["replayed"], r["profile"]["eager"]
        spent = eager if replayed["kernel_ms"] < 0.5 * replayed["wall_ms"] else replayed  # graph kernels unseen
        kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in spent["by_kind_ms"].items())
        lines.append(
            wrap(
                f"- **The graph step** ({r['cache']}, {r['context']:,} x {r['batch']}) takes "
                f"{replayed['wall_ms']:.2f} ms replayed ({r['mean_ms']:.2f} ms timed); its kernels "
                f"({'replayed' if spent is replayed else 'profiled eagerly'}) take {spent['kernel_ms']:.2f} "
                f"ms: {kinds} ms. The modelled figure counts the weight matmuls and the decode attention "
                "only."
            ).replace("\n", "\n  ")
        )
    return lines


def graph_section(path: Path) -> list[str]:
    """The page's CUDA-graph section, from ``path`` (none when it does not exist)."""
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    model = result.get("kernel_model", {})
    return [
        "## Whole-model decode, CUDA graphs",
        "",
        wrap(
            "The same greedy decode steps replayed from CUDA graphs (`GraphDecoder`): the coded cache made static "
            "(`StaticQuantizedLoopKVCache.from_cache`: fixed-capacity buffers, the window a ring, the coded count "
            "read on the device; pages encoded inside the second graph), the bf16 baseline a static cache of the "
            "same capacity with SDPA under a mask (what transformers' static cache does under `torch.compile`). "
            f"\"modelled\": batch / (the weight matmuls' graph + {result['kv']['sites']} x one site's decode "
            f"attention), from `{model.get('file', '-')}` ({model.get('device', '-')}, commit "
            f"`{model.get('commit', '-')}`); the graph's share of it is the measured tokens/s over that figure."
        ),
        "",
        *graph_table(result),
        "",
        *(line for limit in graph_limits(result) for line in (limit, "")),
        provenance(result, path),
        "",
    ]


def latest_section(path: Path) -> list[str]:
    """The kernel as the tree ships, re-measured at 32k x 8 (none when ``path`` does not exist): each method's
    time against bf16 SDPA and against LoopVQ's, one run on one card."""
    if not path.is_file():
        return []
    result = json.loads(path.read_text())
    cases = {r["method"]: r for r in result["cases"] if (r["context"], r["batch"]) == (32768, 8)}
    base = cases.get("loopvq")
    against = (
        [
            f"{METHODS[m]} {r['bf16_ms'] / r['coded_ms']:.2f}x bf16 SDPA, {r['coded_ms'] / base['coded_ms'] - 1:+.1%} "
            "over LoopVQ's time"
            for m, r in cases.items()
            if m != "loopvq"
        ]
        if base
        else []
    )
    return [
        "## The kernel as it ships, re-measured",
        "",
        wrap(
            "The same attention of one KV site at 32k x 8, measured on the tree as it ships now (the "
            "`tasq.grouping: channels` codes read through LoopVQ's fast path with their pairs permuted); ratios "
            "are within this one run" + (f": {'; '.join(against)}." if against else ".")
        ),
        "",
        *attention_table(result),
        "",
        provenance(result, path),
        "",
    ]


def checks_lines(result: dict[str, Any]) -> list[str]:
    """Per method: the served attention's error at every site, and the whole-model logits' error."""
    lines = []
    for check in result["checks"]:
        name = METHODS.get(check["method"], check["method"])
        site = (
            f"per-site relative error of the served attention {check['site_relative_error_median']:.2e} median, "
            f"{check['site_relative_error_max']:.2e} max over the {result['kv']['sites']} sites"
            if "site_relative_error_max" in check
            else "no per-site check"
        )
        lines.append(
            wrap(
                f"- **{name}** ({check['context']:,} tokens x {check['batch']}, through the "
                f"{check.get('site_served_path', check['served_path'])}): {site}; one decode step's logits "
                f"against the model's own cache holding the decoded contents: relative error "
                f"{check['served_relative_error']:.3f} as served, {check['reference_relative_error']:.3f} "
                f"through the cache's PyTorch reference path."
            ).replace("\n", "\n  ")
        )
    return lines + [
        "",
        wrap(
            "Each site's error is the kernel's own fp16 rounding (its tests bound one call at 1e-2); "
            "the logits' larger error is a random-weight network amplifying those errors over "
            "every site, as the reference path's own rounding differences are amplified."
        ),
    ]


def limits(attention: dict[str, Any], whole: dict[str, Any]) -> list[str]:
    """What bounds the kernel and the whole-model step, with the numbers of the two tables."""
    kernel = {(r["context"], r["batch"], r["method"]): r for r in attention["cases"]}
    model = {(r["context"], r["batch"], r["cache"]): r for r in whole["cases"] if r["status"] == "ok"}
    sites = whole["kv"]["sites"]
    lines = []
    r = kernel.get((32768, 8, "loopvq"))
    if r:
        fewer = r["bf16_bytes"] / r["coded_bytes"]
        lines.append(
            f"- **The kernel** reads {fewer:.1f}x fewer bytes than SDPA at 32k x 8 but at "
            f"{r['coded_GBps']:.0f} GB/s against SDPA's {r['bf16_GBps']:.0f} GB/s (the card copies "
            f"at {attention['copy_GBps']:.0f} GB/s, read + written): its token loop's instruction issue and "
            "shared memory bound it, not the memory bandwidth."
        )
    flat = [(c, b) for c, b, m in model if m == "loopvq" and b <= 8 and c <= 32768 and (c, b, m) in kernel]
    if flat:
        steps = [model[(c, b, "loopvq")]["mean_ms"] for c, b in flat]
        att = [sites * kernel[(c, b, "loopvq")]["coded_ms"] for c, b in flat]
        lines.append(
            f"- **The eager decode step** stays at {min(steps):.0f} to {max(steps):.0f} ms (LoopVQ, "
            f"batch 1 and 8, up to 32k tokens) while its {sites} sites of attention take {min(att):.1f} to "
            f"{max(att):.1f} ms: it is bound by the host issuing the forward's kernels, which the "
            "CUDA-graph replay above removes."
        )
    return [wrap(line).replace("\n", "\n  ") for line in lines]


def page(
    kernel: Path = KERNEL, model: Path = MODEL, checks: Path = CHECKS, graph: Path = GRAPH, *, latest: Path = LATEST
) -> str:
    """The whole of docs/decode-speed.md."""
    attention, whole, check = (json.loads(path.read_text()) for path in (kernel, model, checks))
    shapes = whole["kv"]
    quant, serving = whole["quantizer"], whole["serving"]
    errors = ", ".join(f"{METHODS.get(m, m)} {e:.1e}" for m, e in attention["relative_error"].items())
    command = "python benchmarks/decode/decode_speed_table.py --write docs/decode-speed.md"
    lines = [
        "# Decode speed",
        "",
        f"<!-- Generated by `{command}`; do not edit. -->",
        "",
        wrap(
            f"Ouro-1.4B's shapes ({shapes['sites']} KV sites = 24 layers x {shapes['loop_steps']} loop steps, "
            f"{shapes['kv_heads']} KV heads, head dim {shapes['head_dim']}), codes of K {quant['codebook_size']}, "
            f"G {quant['group_size']}, T_c {quant['steps_per_block']} (0.5 bit), random codebooks, codes and "
            "weights (speed does not depend on the values). The coded cache keeps its sink and recent-window "
            "tokens in bf16."
        ),
        "",
        "## Attention of one KV site",
        "",
        wrap(
            "Decode attention read from the codes (the CUDA kernel, which `QuantizedLoopKVCache` runs by default "
            "on CUDA) against PyTorch SDPA over an uncompressed bf16 cache `[batch, 16, context, 128]`: median "
            "microseconds of CUDA-graph replays (launch gaps do not count), 8 sinks + 68 window tokens in bf16. "
            f"Relative error against the float64 reference at these shapes: {errors}."
        ),
        "",
        *attention_table(attention),
        "",
        provenance(attention, kernel),
        "",
        *latest_section(latest),
        "## Whole-model decode",
        "",
        wrap(
            "Greedy decode steps of the native Ouro-1.4B forward (random bf16 weights, eager PyTorch: no CUDA graph, "
            "no `torch.compile`), one new token per sequence and step, through the served cache "
            f"(`QuantizedLoopKVCache`: {serving['sink_tokens']} sinks, a {serving['recent_window']}-token window, "
            f"pages of {serving['page_size']} encoded as they fill) against the model's own bf16 cache "
            f"(`LoopKVCache`). tokens/s = batch / the mean step of {whole['steps']} timed steps after "
            f'{whole["warmup"]} warm-up steps; peak = allocated bytes over the weights. "does not fit": the bf16 '
            "cache needs more than the card's free memory."
        ),
        "",
        *model_table(whole),
        "",
        provenance(whole, model),
        "",
        *graph_section(graph),
        "## What limits it",
        "",
        *limits(attention, whole),
        "",
        "## Checks",
        "",
        *checks_lines(check),
        "",
        provenance(check, checks),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", type=Path, default=KERNEL, help="a bench_decode.py JSON")
    ap.add_argument("--model", type=Path, default=MODEL, help="a bench_decode_model.py JSON")
    ap.add_argument("--checks", type=Path, default=CHECKS, help="a bench_decode_model.py --checks-only JSON")
    ap.add_argument("--graph", type=Path, default=GRAPH, help="a bench_decode_model.py JSON of -graph cases")
    ap.add_argument("--latest", type=Path, default=LATEST, help="a bench_decode.py JSON of the tree as it ships")
    ap.add_argument("--write", type=Path, help="write the page here instead of printing it")
    args = ap.parse_args()
    text = page(args.kernel, args.model, args.checks, args.graph, latest=args.latest)
    if args.write:
        args.write.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
