"""Whole-model greedy decode, measured: the native Ouro forward, one new token per sequence and step, through the
served quantized cache (:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache`: on CUDA the decode kernel, the new
tokens' pages encoded as they fill) against the model's own bf16 cache (:class:`~loopvq_calib.models.LoopKVCache`:
append by concatenation, SDPA), at long contexts and batches; and the same steps replayed from CUDA graphs
(``--caches`` ``loopvq-graph``, ``tasq+loopvq-graph``: the filled cache made static with
:meth:`~loopvq_calib.serving.static_cache.StaticQuantizedLoopKVCache.from_cache` and stepped by
:class:`~loopvq_calib.serving.graph_decode.GraphDecoder`, as served; ``bf16-graph``: a bf16 static cache, SDPA over
its capacity under a mask, replayed by the same decoder: benchmarks/decode/decode_graph.py).

Caches are filled without a prefill (a 64k x 32 prefill would take long, and a bf16 cache of 32k x 8 tokens, 206 GB,
does not fit): the coded cache holds random codes (uniform indices; TaSQ sigmas in [0.5, 1.5)) under a bundle-shaped
quantizer with random float32 codebooks (the method's layouts; TaSQ keys a random per-head permutation, as a fitted
bundle has) and random bf16 sinks/window, via :func:`fill_cache`; the bf16 cache random post-RoPE keys and values
where they fit (else the case says "does not fit" with the bytes). Speed does not depend on the values. Each case:
``--warmup`` steps (graph cases: until both kinds of step are captured), then ``--steps`` timed steps (CUDA events);
median and mean ms per step, tokens/s = batch / mean (the mean over whole pages of steps counts the steps that encode
a page; the median skips them). Every case also carries the whole-model tokens/s that
benchmarks/decode/bench_decode.py models from its kernel times (``--kernel-model``), and graph cases at
``--profile-at`` a profile of ``--profile-steps`` steps' kernels (replayed and eager). Checks first, per method: one
decode step's logits through the coded cache as served (kernel) and through its reference path, against the model's
own cache holding the decoded contents; then the per-site, teacher-forced check (benchmarks/decode/site_check.py):
each KV site's attention output as served against the reference path's, on the reference trajectory (max, median and
every site's relative error).

    python benchmarks/decode/bench_decode_model.py --out benchmarks/results/bench-decode-model-h200.json   # on the GPU
    python benchmarks/decode/bench_decode_model.py --contexts 32768 --batches 8 --caches loopvq loopvq-graph \
        --profile-steps 8 --out graph.json                                             # the graph path at 32k x 8
    python benchmarks/decode/bench_decode_model.py --checks-only --out checks.json               # the checks alone
    python benchmarks/decode/bench_decode_model.py --table-from benchmarks/results/bench-decode-model-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from benchmarks.common.paths import RESULTS, ROOT
from benchmarks.common.provenance import short_commit
from benchmarks.decode.bench_decode_model_tables import against_model, table
from benchmarks.decode.decode_checks import decode_step, run_checks
from benchmarks.decode.decode_fill import Serving, bf16_cache, fill_cache, random_contents, synthetic_quantizer
from benchmarks.decode.decode_graph import (
    StaticBf16Cache,
    kernel_model,
    modelled,
    profile_steps,
    time_graph_steps,
    warmup_bound,
)
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.kernels.backends import CACHE_CHOICES
from loopvq_calib.serving.cache import QuantizedLoopKVCache
from loopvq_calib.serving.graph_decode import GraphDecoder
from loopvq_calib.serving.static_cache import StaticQuantizedLoopKVCache

sys.path.append(str(ROOT / "scripts"))  # make_random_checkpoint (scripts/ is no package)

METHODS = ("loopvq", "tasq+loopvq", "tasq+loopvq-channels")
CACHES = ("bf16", *METHODS, *(f"{c}-graph" for c in ("bf16", *METHODS)))
KERNEL_MODEL = RESULTS / "bench-decode-cuda-h200-run7.json"
GiB = 2**30


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """``--checkpoint`` loaded (scripts/make_random_checkpoint.py writes one), else ``--model`` built on ``device``
    with random bf16 weights."""
    if args.checkpoint:
        from loopvq_calib.models.loading import load_model

        return load_model(args.checkpoint, "bfloat16", device)[0]
    from make_random_checkpoint import random_model

    return random_model(args.model, str(device), seed=args.seed, scale_down=args.scale_down)


@torch.inference_mode()
def time_steps(model: torch.nn.Module, cache: Any, ids: torch.Tensor, *, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` greedy steps after ``warmup`` untimed ones (CUDA events on CUDA)."""
    for _ in range(warmup):
        ids, _ = decode_step(model, cache, ids)
    if ids.device.type != "cuda":
        out = []
        for _ in range(steps):
            start = time.perf_counter()
            ids, _ = decode_step(model, cache, ids)
            out.append((time.perf_counter() - start) * 1e3)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        ids, _ = decode_step(model, cache, ids)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def bf16_bytes(kv: Any, context: int, batch: int) -> int:
    """Bytes of a bf16 cache of ``context`` tokens (keys and values at every site)."""
    return kv.num_sites * 2 * batch * context * kv.kv_heads * kv.head_dim * 2


def held_tokens(context: int, args: argparse.Namespace, *, graph: bool) -> int:
    """Tokens a case's cache holds at most: the context, the warm-up and timed steps, the profile's steps."""
    if not graph:
        return context + args.warmup + args.steps
    return context + warmup_bound(args.warmup, args.page_size) + args.steps + 2 * args.profile_steps + 1


def build_cache(
    model: torch.nn.Module,
    kind: str,
    quantizer: KVQuantizer | None,
    *,
    serving: Serving,
    context: int,
    batch: int,
    args: argparse.Namespace,
    gen: torch.Generator,
) -> Any:
    """The case's cache filled with ``context`` random tokens: eager (the model's own or the coded cache) or
    static (``-graph``: the coded cache made static, or :class:`StaticBf16Cache`), room for the case's steps."""
    kv, device = model.kv_layout(), gen.device
    method, graph = kind.removesuffix("-graph"), kind.endswith("-graph")
    if method == "bf16":
        if graph:
            return StaticBf16Cache(
                kv,
                batch=batch,
                length=context,
                max_length=held_tokens(context, args, graph=True),
                device=device,
                gen=gen,
            )
        return bf16_cache(kv, context, batch, device=device, gen=gen)
    cache = fill_cache(
        QuantizedLoopKVCache(quantizer, **dataclasses.asdict(serving)),
        **random_contents(quantizer, serving, context, batch=batch, device=device, gen=gen),
    )
    if graph:
        return StaticQuantizedLoopKVCache.from_cache(cache, max_length=held_tokens(context, args, graph=True))
    return cache


def time_case(
    model: torch.nn.Module, kind: str, cache: Any, *, ids: torch.Tensor, args: argparse.Namespace, profiled: bool
) -> tuple[list[float], dict[str, Any]]:
    """Step times of the case and what else it records: the path that served, the profile."""
    extra: dict[str, Any] = {}
    if not kind.endswith("-graph"):
        ms = time_steps(model, cache, ids, warmup=args.warmup, steps=args.steps)
    else:
        decoder = GraphDecoder(model, cache)
        kinds = 1 if kind.startswith("bf16") else 2
        ms = time_graph_steps(decoder, ids, warmup=args.warmup, steps=args.steps, kinds=kinds)
        extra["graphs"] = len(decoder.graphs)
        if profiled:
            eager = GraphDecoder(model, cache, graphs=False)  # after the replays: its positions are the cache's
            extra["profile"] = {"replayed": profile_steps(lambda: decoder.step(ids), args.profile_steps)}
            extra["profile"]["eager"] = profile_steps(lambda: eager.step(ids), args.profile_steps)
    if not kind.startswith("bf16"):
        extra["served_path"] = "kernel" if cache.served_by_kernel else "reference"
    return ms, extra


def run_case(
    model: torch.nn.Module,
    cache_kind: str,
    quantizer: KVQuantizer | None,
    *,
    serving: Serving,
    context: int,
    batch: int,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """Fill one cache at (context, batch), time its decode steps; "does not fit" / "out of memory" with the bytes."""
    kv = model.kv_layout()
    out: dict[str, Any] = {"context": context, "batch": batch, "cache": cache_kind}
    gen = torch.Generator(device).manual_seed(args.seed + context + batch)
    cuda, graph = device.type == "cuda", cache_kind.endswith("-graph")
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # what earlier cases left in the allocator counts as free
    if cache_kind.startswith("bf16"):
        held = held_tokens(context, args, graph=graph)
        need = bf16_bytes(kv, held, batch) + (0 if graph else bf16_bytes(kv, held, batch) // (2 * kv.num_sites))
        out["bf16_bytes"] = need  # (eager: + one site's growth)
        free = torch.cuda.mem_get_info(device)[0] if cuda else None
        if free is not None and need + GiB > free:
            out.update(status="does not fit", free_bytes=free)
            return out
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        cache = build_cache(
            model, cache_kind, quantizer, serving=serving, context=context, batch=batch, args=args, gen=gen
        )
        if cuda and graph:  # the static cache's peak, not its conversion's
            gc.collect()
            torch.cuda.reset_peak_memory_stats(device)
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device, generator=gen)
        profiled = graph and cuda and args.profile_steps > 0 and [context, batch] == args.profile_at
        ms, extra = time_case(model, cache_kind, cache, ids=ids, args=args, profiled=profiled)
        out.update(cache_bytes=cache.nbytes(), **extra)
    except torch.cuda.OutOfMemoryError as err:
        out.update(status="out of memory", error=str(err).splitlines()[0])
        return out
    finally:
        cache = None
        gc.collect()
        if cuda:
            out["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            torch.cuda.empty_cache()
    mean = statistics.fmean(ms)
    out.update(status="ok", step_ms=ms, median_ms=statistics.median(ms), mean_ms=mean, tokens_per_s=batch / mean * 1e3)
    figure = modelled(args.model_figures, context, batch, cache=cache_kind)
    if figure is not None:
        out["modelled_tokens_per_s"] = figure
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ouro-1.4b", choices=["ouro-1.4b", "ouro-2.6b"])
    ap.add_argument("--checkpoint", type=Path, help="a model folder (make_random_checkpoint.py) instead of --model")
    ap.add_argument("--scale-down", type=int, default=1, help="divide --model's widths and layers (CPU tests)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--caches",
        nargs="+",
        default=["bf16", *METHODS],
        choices=CACHES,
        help="-graph: the static cache's steps replayed from CUDA graphs",
    )
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument(
        "--steps",
        type=int,
        default=32,
        help="timed steps (a multiple of --page-size counts the page encodes in proportion)",
    )
    ap.add_argument("--codebook-size", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--steps-per-block", type=int, default=4)
    ap.add_argument("--sink-tokens", type=int, default=8)
    ap.add_argument("--recent-window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument("--check-context", type=int, default=1024, help="context of the logits check (0: none)")
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument(
        "--check-kernel",
        default="auto",
        choices=[b.value for b in CACHE_CHOICES],
        help="the served cache's backend in the checks (triton: also on CPU under TRITON_INTERPRET=1)",
    )
    ap.add_argument("--checks-only", action="store_true", help="run the checks, no timed cases")
    ap.add_argument(
        "--kernel-model",
        type=Path,
        default=KERNEL_MODEL,
        help="a bench_decode.py JSON whose modelled whole-model tokens/s each case is compared with",
    )
    ap.add_argument(
        "--profile-steps", type=int, default=0, help="profile this many steps of each graph case at --profile-at (CUDA)"
    )
    ap.add_argument("--profile-at", type=int, nargs=2, default=[32768, 8], metavar=("CONTEXT", "BATCH"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--table-from", type=Path, help="print the markdown table of a saved result and exit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.out is None and not args.table_from:
        ap.error("--out is required")
    return args


def main() -> None:
    args = parse_args()
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())))
        return
    device = torch.device(args.device)
    serving = Serving(args.sink_tokens, args.recent_window, args.page_size)
    model = build_model(args, device)
    kv = model.kv_layout()
    commit = args.commit or short_commit()
    args.model_figures = kernel_model(args.kernel_model)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "commit": commit,
        "command": " ".join(["python", "benchmarks/decode/bench_decode_model.py", *sys.argv[1:]]),
        "model": str(args.checkpoint or args.model),
        "scale_down": args.scale_down,
        "kv": {"sites": kv.num_sites, "kv_heads": kv.kv_heads, "head_dim": kv.head_dim, "loop_steps": kv.loop_steps},
        "quantizer": {
            "codebook_size": args.codebook_size,
            "group_size": args.group_size,
            "steps_per_block": args.steps_per_block,
        },
        "serving": dataclasses.asdict(serving),
        "warmup": args.warmup,
        "steps": args.steps,
        "check_kernel": args.check_kernel,
        "checks": [],
        "cases": [],
    }
    if args.model_figures:
        result["kernel_model"] = {k: v for k, v in args.model_figures.items() if k != "tokens_per_s"}
    methods = {c.removesuffix("-graph") for c in args.caches} & set(METHODS)
    quantizers = {
        m: synthetic_quantizer(
            kv,
            m,
            codebook_size=args.codebook_size,
            group_size=args.group_size,
            steps_per_block=args.steps_per_block,
            device=device,
            seed=args.seed,
        )
        for m in METHODS
        if m in methods
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.check_context:
        run_checks(model, quantizers, serving, result=result, args=args, device=device)
    for context in [] if args.checks_only else args.contexts:
        for batch in args.batches:
            for kind in args.caches:
                r = run_case(
                    model,
                    kind,
                    quantizers.get(kind.removesuffix("-graph")),
                    serving=serving,
                    context=context,
                    batch=batch,
                    args=args,
                    device=device,
                )
                result["cases"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("step_ms", "profile")}), flush=True)
                args.out.write_text(json.dumps(result, indent=1))  # after every case: a cut-off run keeps its cases
    print(table(result))
    print("\n".join(against_model(result)))


if __name__ == "__main__":
    main()
