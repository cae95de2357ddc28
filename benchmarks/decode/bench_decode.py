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
from benchmarks.decode.bench_decode_launches import attention_arguments, parse_variant, table_launch
from benchmarks.decode.bench_decode_shapes import (
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    SINKS,
    SITES,
    STEPS,
    T_C,
    THETA,
    VOCAB,
    WEIGHT_BYTES,
    WINDOW,
    D,
    G,
    K,
)
from benchmarks.decode.bench_decode_tables import against_loopvq, fixed_cost, sequences_that_fit, table
from benchmarks.decode.decode_fill import channels_groups
from loopvq_calib.codes.codec import BlockCodec, TasqTransform
from loopvq_calib.codes.layouts import BlockLayout, loop_axis_groups
from loopvq_calib.serving import decode_attention as da

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


def parse_args() -> argparse.Namespace:
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
    if args.out is None and not args.table_from:
        ap.error("--out is required")
    return args


def print_saved(path: Path) -> None:
    """``--table-from``: the markdown tables of a saved result, and when it has cases the lines on them."""
    saved = json.loads(path.read_text())
    print(table(saved))
    if saved["cases"]:
        print("\n" + against_loopvq(saved) + "\n" + fixed_cost(saved) + "\n" + sequences_that_fit(saved))


def checked_tables(methods: list[str], *, device: torch.device) -> tuple[dict[str, da.StepTables], dict[str, float]]:
    """Per method: the step tables of its random codecs, and their relative error against the float64 reference."""
    tables, accuracy = {}, {}
    for method in methods:
        kc, vc = codecs(method)
        tables[method] = da.step_tables(kc, vc, 2, rope_style="half", device=device, dtype=torch.float16)
        accuracy[method] = check_accuracy(tables[method], kc, vc, device=device)
        print(f"{method}: relative error vs float64 reference {accuracy[method]:.2e}", flush=True)
    return tables, accuracy


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The run's result: the card's copy bandwidth, each method's accuracy, the kernel variants, and (unless
    ``--variants-only``) every (context, batch, method) case, the bodies' times and what fits at batch 1."""
    global K
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
    tables, result["relative_error"] = checked_tables(args.methods, device=device)
    result["launches"] = run_variants(args.variants, args.methods, tables, device=device)
    launch = table_launch(args.table_variant, args.methods, result["launches"])
    result["table_launch"] = launch
    if args.variants_only:
        return result
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
                save(result, args.out)  # after every case: a cut-off run keeps its cases
    result["fits_batch1"] = fits_batch1(device)
    return result


def save(result: dict[str, Any], out: Path) -> None:
    """Write ``result`` as JSON to ``out`` (its folder created)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def main() -> None:
    args = parse_args()
    if args.table_from:
        print_saved(args.table_from)
        return
    result = measure(args)
    save(result, args.out)
    if not args.variants_only:
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


if __name__ == "__main__":
    main()
