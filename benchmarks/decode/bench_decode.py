"""Decode attention from coded pages (the CUDA shared-memory kernel, or the Triton one) against bf16 attention over an
uncompressed cache (PyTorch SDPA), at Ouro-1.4B's shapes: 24 layers x 4 loop steps = 96 KV sites, 16 query and 16 KV
heads, head dim 128; codes LoopVQ K 256, G 16, T_c 4 (0.5 bit; 32 index bytes per head and kind and token, shared by
the block's 4 steps); 8 sinks + 68 window tokens in bf16 (the serving defaults, mid-page). Methods: ``loopvq``,
``tasq+loopvq`` (TaSQ keys of the ``free`` grouping: any permutation, read channel by channel) and
``tasq+loopvq-channels`` (``tasq.grouping: channels``: each code the same 2 RoPE pairs at every step, read through the
LoopVQ path with the pairs permuted), all through ``step_tables`` and ``decode_attention`` as served.

For every (context, batch): the median time of one site's attention (CUDA-graph replays, so launch gaps do
not count), the bytes it must read, the bandwidth that implies, and whole-model decode tokens/s =
batch / (body + 96 * attention), where ``body`` is a CUDA graph of the model's weight matmuls for one decode
step (q/k/v/o projections and SwiGLU of 24 layers x 4 steps, the LM head; norms and elementwise work left
out). Also: the copy bandwidth of the card (device-to-device, bytes read + written) and the longest context
that fits at batch 1 (free memory after the weights, over the cache bytes per token).

    python benchmarks/decode/bench_decode.py --out benchmarks/results/bench-decode-h200.json     # on the GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch
import torch.nn.functional as F

from benchmarks.common.provenance import short_commit
from benchmarks.decode.decode_fill import channels_groups
from loopvq_calib.codes.codec import BlockCodec, TasqTransform
from loopvq_calib.codes.layouts import BlockLayout, loop_axis_groups
from loopvq_calib.serving import decode_attention as da

LAYERS, STEPS, HEADS, KV_HEADS, D = 24, 4, 16, 16, 128
HIDDEN, INTER, VOCAB, THETA = 2048, 5632, 49152, 1_000_000.0
K, G, T_C = 256, 16, 4
SINKS, WINDOW = 8, 68
SITES = LAYERS * STEPS
WEIGHT_BYTES = 2 * (LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER) + 2 * VOCAB * HIDDEN)
METHODS = ("loopvq", "tasq+loopvq", "tasq+loopvq-channels")


def codecs(method: str) -> tuple[BlockCodec, BlockCodec]:
    """One block's random codebooks with the method's layouts (TaSQ free: a random per-head permutation; TaSQ
    channels: :func:`~benchmarks.decode.decode_fill.channels_groups`)."""
    gen = torch.Generator().manual_seed(0)
    plain = loop_axis_groups(D, T_C, G)[None]
    keys = plain
    if method == "tasq+loopvq":
        keys = torch.stack([torch.randperm(T_C * D, generator=gen) for _ in range(KV_HEADS)]).view(KV_HEADS, -1, G)
    elif method == "tasq+loopvq-channels":
        keys = channels_groups(SimpleNamespace(head_dim=D, kv_heads=KV_HEADS, rope_style="half"), T_C, G, gen)

    def make(kind: str, groups: torch.Tensor, tasq: bool) -> BlockCodec:
        lay = BlockLayout("b0.l0", kind, tuple(range(T_C)), D, KV_HEADS, groups)
        transform = TasqTransform(torch.rand(T_C, KV_HEADS, D, generator=gen) + 0.5) if tasq else None
        return BlockCodec(lay, torch.randn(KV_HEADS, D * T_C // G, K, G, generator=gen).half(), transform)

    return make("key", keys, method.startswith("tasq")), make("value", plain, False)


def graph_ms(fn: Callable[[], Any], reps: int = 50) -> float:
    """Median time of ``fn`` replayed from a CUDA graph (triton.testing.do_bench_cudagraph)."""
    from triton.testing import do_bench_cudagraph

    return float(do_bench_cudagraph(fn, rep=reps, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 4 GiB: (read + written) bytes / median time, GB/s."""
    src = torch.empty(2**30, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src))  # noqa: F821
    del src, dst
    return 2 * 4 * 2**30 / ms / 1e6


def body_ms(batch: int, device: torch.device) -> float:
    """One decode step's weight matmuls (distinct weights per layer; each layer runs 4 steps) from a graph."""
    w = [
        [
            torch.randn(o, i, device=device, dtype=torch.bfloat16) * 0.02
            for o, i in ((3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))
        ]
        for _ in range(LAYERS)
    ]
    head = torch.randn(VOCAB, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h = x
        for _ in range(STEPS):
            for qkv, o, gate_up, down in w:  # noqa: F821
                a = F.linear(F.linear(h, qkv)[:, :HIDDEN], o)
                gu = F.linear(a, gate_up)
                h = F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], down)
        return F.linear(h, head)  # noqa: F821

    ms = graph_ms(step, reps=20)
    del w, head
    return ms


def random_indices(batch: int, n: int, n_groups: int, *, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Random uint8 codes [B, n, H, n_groups] stored head-major, as the cache's CodeBuffer stores them."""
    idx = torch.randint(0, K, (batch, KV_HEADS, n, n_groups), device=device, dtype=torch.uint8, generator=gen)
    return idx.transpose(1, 2)


def parse_variant(spec: str) -> dict:
    """``cuda-WxUxL[xR]`` (warps per block x tokens per lane group and step x lanes per token x most batch rows per
    pass, default 1; a trailing ``f``: the key table in float32) or ``triton-NxWxPxS`` (block_n x num_warps x
    programs per multiprocessor x sequences per program) -> the launch's settings (:func:`attention_arguments` turns
    them into decode_attention's keyword arguments)."""
    backend, shape = spec.split("-")
    nums = [int(x) for x in shape.rstrip("f").split("x")]
    if backend == "cuda":
        return {
            "backend": "cuda",
            "warps": nums[0],
            "tokens_per_iteration": nums[1],
            "lanes_per_token": nums[2],
            "rows_per_pass": nums[3] if len(nums) > 3 else 1,
            "key_float32": shape.endswith("f") or None,
        }
    return {
        "backend": "triton",
        "block_n": nums[0],
        "num_warps": nums[1],
        "programs_per_sm": nums[2],
        "batch_per_program": nums[3],
    }


def attention_arguments(launch: dict) -> dict:
    """decode_attention's keyword arguments for a launch of :func:`parse_variant` (or ``{"backend": "auto"}``)."""
    settings = {k: v for k, v in launch.items() if k != "backend"}
    if launch["backend"] == "cuda":
        return {"backend": "cuda", "cuda": da.CudaDecodeLaunch(**settings)}
    if launch["backend"] == "triton":
        return {"backend": "triton", "triton": da.TritonDecodeLaunch(**settings)}
    return {"backend": launch["backend"]}


def bench_case(
    context: int, batch: int, method: str, *, tables: da.StepTables, device: torch.device, launch: dict
) -> dict:
    gen = torch.Generator(device=device).manual_seed(context + batch)
    n = context - SINKS - WINDOW
    n_groups = D * T_C // G
    q = torch.randn(batch, HEADS, D, device=device, dtype=torch.bfloat16, generator=gen)
    coded = da.CodedTokens(
        random_indices(batch, n, n_groups, device=device, gen=gen),
        random_indices(batch, n, n_groups, device=device, gen=gen),
        (torch.rand(batch, n, T_C, device=device, generator=gen) + 0.5).half() if tables.tasq else None,
        n,
        torch.full((batch,), SINKS, device=device, dtype=torch.int32),
    )
    fp = torch.randn(2, batch, SINKS + WINDOW, KV_HEADS, D, device=device, dtype=torch.bfloat16, generator=gen)
    fpos = torch.cat([torch.arange(SINKS), torch.arange(SINKS + n, context)]).to(device, torch.int32)
    fpos = fpos[None].repeat(batch, 1)
    rope = da.RopeTable(D, THETA)

    def coded_call() -> torch.Tensor:
        full = da.FullPrecisionTokens(fp[0], fp[1], fpos)  # noqa: F821
        return da.decode_attention(
            q,
            tables,
            coded,  # noqa: F821
            fp=full,
            rope=rope,
            max_position=context,
            **attention_arguments(launch),
        )

    coded_call()
    coded_ms = graph_ms(coded_call)
    sigma = 2 * batch * n if tables.tasq else 0
    coded_bytes = (
        batch * n * KV_HEADS * 2 * n_groups
        + sigma
        + 2 * fp[0].numel() * 2
        + sum(t.numel() * t.element_size() for t in (tables.key_a, tables.key_b, tables.value))
    )
    out = {
        "context": context,
        "batch": batch,
        "method": method,
        "coded_ms": coded_ms,
        "coded_bytes": coded_bytes,
        "coded_GBps": coded_bytes / coded_ms / 1e6,
        **launch,
    }
    del coded, fp
    bf16_bytes = 2 * batch * KV_HEADS * context * D * 2
    kv = torch.randn(2, batch, KV_HEADS, context, D, device=device, dtype=torch.bfloat16, generator=gen)
    q4 = q[:, :, None, :]
    out["bf16_ms"] = graph_ms(lambda: F.scaled_dot_product_attention(q4, kv[0], kv[1]))  # noqa: F821
    out.update(bf16_bytes=bf16_bytes, bf16_GBps=bf16_bytes / out["bf16_ms"] / 1e6, speedup=out["bf16_ms"] / coded_ms)
    del kv
    torch.cuda.empty_cache()
    return out


def check_accuracy(tables: da.StepTables, kc: BlockCodec, vc: BlockCodec, *, device: torch.device) -> float:
    """Relative error against the float64 reference at these shapes (batch 2, 3000 coded tokens)."""
    gen = torch.Generator().manual_seed(1)
    n, s = 3000, SINKS + WINDOW
    coded = da.CodedTokens(
        random_indices(2, n, 32, device=torch.device("cpu"), gen=gen),
        random_indices(2, n, 32, device=torch.device("cpu"), gen=gen),
        (torch.rand(2, n, T_C, generator=gen) + 0.5).half() if tables.tasq else None,
        n,
        torch.tensor([SINKS, SINKS]),
    )
    q = torch.randn(2, HEADS, D, generator=gen).bfloat16()
    fk, fv = (torch.randn(2, s, KV_HEADS, D, generator=gen).bfloat16() for _ in range(2))
    fpos = torch.cat([torch.arange(SINKS), torch.arange(SINKS + n, SINKS + n + WINDOW)])[None].repeat(2, 1)
    moved = da.CodedTokens(
        coded.key_indices.to(device),
        coded.value_indices.to(device),
        None if coded.key_sigma is None else coded.key_sigma.to(device),
        n,
        coded.first_position,
    )
    full = da.FullPrecisionTokens(fk.to(device), fv.to(device), fpos.to(device))
    out = da.decode_attention(q.to(device), tables, moved, fp=full, rope=da.RopeTable(D, THETA))
    ref = da.decode_attention_reference(
        q.float(),
        kc,
        vc,
        step=tables.step,
        coded=coded,
        fp_keys=fk,
        fp_values=fv,
        fp_positions=fpos,
        fp_mask=None,
        rope_style="half",
        rope_theta=THETA,
    )
    return float((out.cpu().double() - ref).norm() / ref.norm())


def main() -> None:
    global K
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument(
        "--variants",
        default="cuda-16x8x16x8,cuda-16x16x16x8,cuda-16x8x16x2f,cuda-16x16x16x2",
        help="kernel variants tried at 32k, batch 8 (see parse_variant); the table runs the defaults",
    )
    ap.add_argument(
        "--codebook-size",
        type=int,
        default=K,
        help="K (256 is the 0.5-bit bundle; smaller K shrinks the "
        "step tables, to see what a cache-resident codebook slice gives)",
    )
    ap.add_argument("--variants-only", action="store_true", help="only the kernel variants at 32k, batch 8")
    ap.add_argument(
        "--table-variant",
        default="auto",
        help="launch of the table: 'auto' (decode_attention's "
        "defaults), 'best' (per method, the fastest of --variants at 32k, batch 8) or a variant",
    )
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--table-from", type=Path, help="print the markdown tables of a saved result and exit (no GPU)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.table_from:
        saved = json.loads(args.table_from.read_text())
        print(table(saved))
        if saved["cases"]:
            print("\n" + against_loopvq(saved) + "\n" + fixed_cost(saved) + "\n" + sequences_that_fit(saved))
        return
    if args.out is None:
        ap.error("--out is required")
    K = args.codebook_size
    device = torch.device("cuda")
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "codebook_size": K,
        "commit": args.commit or short_commit(),
        "command": " ".join(["python", "benchmarks/decode/bench_decode.py", *sys.argv[1:]]),
        "copy_GBps": copy_bandwidth(device),
        "cases": [],
        "launches": [],
    }
    print(f"copy bandwidth {result['copy_GBps']:.0f} GB/s", flush=True)
    tables, accuracy = {}, {}
    for method in args.methods:
        kc, vc = codecs(method)
        tables[method] = da.step_tables(kc, vc, 2, rope_style="half", device=device, dtype=torch.float16)
        accuracy[method] = check_accuracy(tables[method], kc, vc, device=device)
        print(f"{method}: relative error vs float64 reference {accuracy[method]:.2e}", flush=True)
    result["relative_error"] = accuracy
    result["launches"] = run_variants(args.variants, args.methods, tables, device=device)
    launch = {m: {"backend": "auto"} for m in args.methods}  # the table: what a caller gets by default
    if args.table_variant == "best" and result["launches"]:
        for m in args.methods:
            runs = [r for r in result["launches"] if r["method"] == m]
            launch[m] = parse_variant(min(runs, key=lambda r: r["coded_ms"])["variant"]) if runs else launch[m]
    elif args.table_variant != "auto":
        launch = {m: parse_variant(args.table_variant) for m in args.methods}
    result["table_launch"] = launch
    if args.variants_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        return
    bodies = {b: body_ms(b, device) for b in args.batches}
    result["body_ms"] = bodies
    for context in sorted(set(args.contexts) | {32768}):
        for batch in args.batches:
            for method in args.methods:
                r = bench_case(context, batch, method, tables=tables[method], device=device, launch=launch[method])
                for kind in ("coded", "bf16"):
                    r[f"{kind}_tokens_per_s"] = batch / (bodies[batch] + SITES * r[f"{kind}_ms"]) * 1e3
                result["cases"].append(r)
                print(json.dumps(r), flush=True)
    result["fits_batch1"] = fits_batch1(device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))
    print(against_loopvq(result))


def run_variants(
    variants: str, methods: list[str], tables: dict[str, da.StepTables], *, device: torch.device
) -> list[dict]:
    """Every kernel variant of the comma-separated ``variants`` (see :func:`parse_variant`) at 32k, batch 8, per
    method; a variant the kernel refuses here (shared memory) is printed and left out."""
    out = []
    for spec in filter(None, variants.split(",")):
        for method in methods:
            try:
                r = bench_case(32768, 8, method, tables=tables[method], device=device, launch=parse_variant(spec))
            except (RuntimeError, ValueError) as err:
                print(f"{spec} {method}: not run ({err})", flush=True)
                continue
            r["variant"] = spec
            out.append(r)
            print(f"{spec} {method}: coded {r['coded_ms'] * 1e3:.1f} us, bf16 {r['bf16_ms'] * 1e3:.1f} us", flush=True)
    return out


def fits_batch1(device: torch.device) -> dict:
    """The longest context one sequence fits in: the card's memory less the weights and 2 GiB (activations, the
    allocator) over a bf16 cache's bytes per token, and over the codes' (with fp16 step tables and bf16
    sinks/window)."""
    _, total = torch.cuda.mem_get_info(device)
    code_bytes = SITES // T_C * 2 * KV_HEADS * 32  # 24 blocks x (K, V) x 16 heads x 32 index bytes
    codebooks = SITES * 2 * KV_HEADS * K * D * 2  # fp16 step tables
    spare = total - WEIGHT_BYTES - 2 * 2**30
    return {
        "total_bytes": total,
        "weight_bytes": WEIGHT_BYTES,
        "bf16_tokens": spare // (SITES * 2 * KV_HEADS * D * 2),
        "coded_tokens": (spare - codebooks - (SINKS + WINDOW) * SITES * 2 * KV_HEADS * D * 2) // code_bytes
        + SINKS
        + WINDOW,
    }


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


if __name__ == "__main__":
    main()
