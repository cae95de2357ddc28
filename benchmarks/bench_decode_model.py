"""Whole-model greedy decode, measured: the native Ouro forward, one new token per sequence and step, through the
served quantized cache (:class:`~loopvq_calib.serving.cache.QuantizedLoopKVCache`: on CUDA the decode kernel, the new
tokens' pages encoded as they fill) against the model's own bf16 cache (:class:`~loopvq_calib.models.LoopKVCache`:
append by concatenation, SDPA), at long contexts and batches.

Caches are filled without a prefill (a 64k x 32 prefill would take long, and a bf16 cache of 32k x 8 tokens,
206 GB, does not fit): the coded cache holds random codes (uniform indices; TaSQ sigmas in [0.5, 1.5)) under a
bundle-shaped quantizer with random float32 codebooks (the method's layouts; TaSQ keys a random per-head
permutation, as a fitted bundle has) and random bf16 sinks/window, via :func:`fill_cache`; the bf16
cache random post-RoPE keys and values where they fit (else the case says "does not fit" with the bytes).
Speed does not depend on the values. Each case: ``--warmup`` steps, then ``--steps`` timed steps (CUDA events);
median and mean ms per step, tokens/s = batch / mean (the mean over whole pages of steps counts the steps that
encode a page; the median skips them). Checks first, per method: one decode step's logits through the coded cache
as served (kernel) and through its reference path, against the model's own cache holding the decoded contents;
then the per-site, teacher-forced check (benchmarks/site_check.py): each KV site's attention output as served against
the reference path's, on the reference trajectory (max, median and every site's relative error).

    python benchmarks/bench_decode_model.py --out benchmarks/results/bench-decode-model-h200.json   # on the GPU
    python benchmarks/bench_decode_model.py --checks-only --out checks.json               # the checks alone
    python benchmarks/bench_decode_model.py --table-from benchmarks/results/bench-decode-model-h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from site_check import SiteCheckCache  # noqa: E402

from loopvq_calib.codes.codec import BlockCodec, Codes, TasqTransform, index_dtype  # noqa: E402
from loopvq_calib.codes.layouts import plan_layouts  # noqa: E402
from loopvq_calib.codes.quantizer import KVQuantizer  # noqa: E402
from loopvq_calib.config.schema import QuantConfig  # noqa: E402
from loopvq_calib.kernels.backends import CACHE_CHOICES  # noqa: E402
from loopvq_calib.models import LoopKVCache  # noqa: E402
from loopvq_calib.models.common import apply_rope, rope_angles  # noqa: E402
from loopvq_calib.serving.cache import QuantizedLoopKVCache  # noqa: E402

METHODS = ("loopvq", "tasq+loopvq")
GiB = 2**30


@dataclasses.dataclass
class Serving:
    """The served cache's regions (the bundle's serving defaults)."""

    sink_tokens: int = 8
    recent_window: int = 64
    page_size: int = 8


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """``--checkpoint`` loaded (scripts/make_random_checkpoint.py writes one), else ``--model`` built on ``device``
    with random bf16 weights."""
    if args.checkpoint:
        from loopvq_calib.models.loading import load_model

        return load_model(args.checkpoint, "bfloat16", device)[0]
    from make_random_checkpoint import random_model

    return random_model(args.model, str(device), seed=args.seed, scale_down=args.scale_down)


def synthetic_quantizer(kv: Any, method: str, *, codebook_size: int, group_size: int, steps_per_block: int,
                        device: torch.device, seed: int = 0) -> KVQuantizer:
    """A bundle-shaped quantizer: the method's layouts, random float32 codebooks; TaSQ keys grouped by a random
    per-head permutation with random channel weights."""
    quant = QuantConfig(method=method, bits=None, codebook_size=codebook_size, group_size=group_size,
                        steps_per_block=steps_per_block)
    gen, on_device = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)
    codecs = {}
    for layout in plan_layouts(kv, quant):
        transform = None
        if quant.uses_tasq and layout.kind == "key":
            coords = layout.steps * kv.head_dim
            perm = torch.stack([torch.randperm(coords, generator=gen) for _ in range(kv.kv_heads)])
            layout = dataclasses.replace(layout, groups=perm.view(kv.kv_heads, -1, group_size))
            weight = torch.rand(layout.steps, kv.kv_heads, kv.head_dim, generator=gen) + 0.5
            transform = TasqTransform(weight.to(device))
        book = torch.randn(kv.kv_heads, layout.num_groups, codebook_size, group_size, generator=on_device,
                           device=device)
        codecs[layout.key] = BlockCodec(layout, book, transform)
    return KVQuantizer(codecs, method, codebook_size, group_size, quant.block_steps, "none", kv)


def coded_pages(context: int, serving: Serving) -> int:
    """Pages a cache of ``context`` tokens holds as codes after a prefill (window in [recent, recent + page))."""
    return max(context - serving.sink_tokens - serving.recent_window, 0) // serving.page_size


def fill_cache(cache: QuantizedLoopKVCache, keys: dict[int, torch.Tensor], values: dict[int, torch.Tensor], *,
               positions: torch.Tensor, codes: dict[str, list[Codes]]) -> QuantizedLoopKVCache:
    """Give an empty ``store="indices"`` cache the contents a prefill leaves, without a forward: per KV site the
    pre-RoPE sink and window tokens ``keys`` / ``values`` [B, S_fp, H, D] (the first ``sink_tokens`` are the
    sinks); ``positions`` [B, S], every token's position (an unpadded batch, shared by the sites); per codec the
    codes of its encoded pages, oldest first, each page's rows batch-major (b * page_size + token). S = S_fp +
    page_size * pages. Returns the cache."""
    if cache.keys or cache.store != "indices":
        raise ValueError("fill_cache needs an empty cache with store='indices'")
    sites = {s.site for s in cache.quantizer.kv.sites}
    if set(keys) != sites or set(values) != sites or set(codes) != set(cache.quantizer.codecs):
        raise ValueError("fill_cache needs keys and values for every KV site and codes for every codec")
    pages = {len(p) for p in codes.values()}
    fp = {t.shape[1] for t in (*keys.values(), *values.values())}
    if len(pages) != 1 or len(fp) != 1:
        raise ValueError(f"every codec needs the same number of pages (got {sorted(pages)}) and every site the "
                         f"same full-precision tokens (got {sorted(fp)})")
    encoded, n_fp = pages.pop() * cache.page_size, fp.pop()
    if (encoded and n_fp < cache.sink_tokens) or n_fp + encoded != positions.shape[1]:
        raise ValueError(f"{n_fp} full-precision and {encoded} coded tokens with {cache.sink_tokens} sinks do not "
                         f"make the {positions.shape[1]} positions given")
    cache.keys, cache.values = dict(keys), dict(values)
    cache.positions = dict.fromkeys(sites, positions)
    cache.codes = {name: list(p) for name, p in codes.items()}
    cache.encoded, cache.sink_columns = encoded, cache.sink_tokens
    return cache


def random_contents(quantizer: KVQuantizer, serving: Serving, context: int, *, batch: int, device: torch.device,
                    gen: torch.Generator) -> dict[str, Any]:
    """Arguments of :func:`fill_cache`: random bf16 sinks/window and random codes of every page (each
    codec's pages views of one tensor)."""
    kv, page = quantizer.kv, serving.page_size
    pages = coded_pages(context, serving)
    n_fp = context - pages * page
    shape = (batch, n_fp, kv.kv_heads, kv.head_dim)
    keys = {s.site: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) for s in kv.sites}
    values = {s.site: torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) for s in kv.sites}
    codes = {}
    for name, codec in quantizer.codecs.items():
        rows = (pages, batch * page)
        idx = torch.randint(0, codec.codebook.shape[2], (*rows, kv.kv_heads, codec.layout.num_groups), device=device,
                            generator=gen, dtype=index_dtype(codec.codebook.shape[2]))
        sigma = None
        if codec.transform is not None:
            sigma = (torch.rand(*rows, codec.layout.steps, device=device, generator=gen) + 0.5).half()
        codes[name] = [Codes(idx[i], None if sigma is None else sigma[i]) for i in range(pages)]
    positions = torch.arange(context, device=device).repeat(batch, 1)
    return {"keys": keys, "values": values, "positions": positions, "codes": codes}


def decoded_cache(quantizer: KVQuantizer, contents: dict[str, Any], serving: Serving) -> LoopKVCache:
    """The model's own cache holding ``contents`` decoded (codes -> bf16, then RoPE at their positions): what the
    coded cache must serve."""
    kv, page, sinks = quantizer.kv, serving.page_size, serving.sink_tokens
    keys, values, positions = contents["keys"], contents["values"], contents["positions"]
    batch = positions.shape[0]
    cache = LoopKVCache()
    for name, codec in quantizer.codecs.items():
        pages = contents["codes"][name]
        full = keys if codec.layout.kind == "key" else values
        if pages:
            codes = Codes(torch.cat([c.indices for c in pages]),
                          None if pages[0].sigma is None else torch.cat([c.sigma for c in pages]))
            x = codec.decode(codes).view(len(pages), batch, page, codec.layout.steps, kv.kv_heads, kv.head_dim)
            x = x.transpose(0, 1).flatten(1, 2)  # [B, pages * page, T, H, D]
        for m, site in enumerate(codec.layout.sites):
            t = full[site]
            if pages:
                t = torch.cat([t[:, :sinks], x[:, :, m].to(t.dtype), t[:, sinks:]], 1)
            if codec.layout.kind == "key":
                cache.keys[site] = apply_rope(t, *rope_angles(positions, kv.head_dim, kv.rope_theta), style=kv.rope_style)
            else:
                cache.values[site] = t
    return cache


def bf16_cache(kv: Any, context: int, batch: int, *, device: torch.device, gen: torch.Generator) -> LoopKVCache:
    """The model's own cache holding random post-RoPE keys and values of ``context`` tokens at every site."""
    cache = LoopKVCache()
    shape = (batch, context, kv.kv_heads, kv.head_dim)
    for s in kv.sites:
        cache.keys[s.site] = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
        cache.values[s.site] = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16)
    return cache


def decode_step(model: torch.nn.Module, cache: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One greedy step: (next token ids [B, 1], logits [B, V])."""
    logits = model(ids, cache=cache, use_cache=True).logits[:, -1]
    return logits.argmax(-1, keepdim=True), logits


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


@torch.inference_mode()
def check_fill(model: torch.nn.Module, quantizer: KVQuantizer, serving: Serving, *, context: int, batch: int,
               device: torch.device, seed: int = 0, backend: str = "auto") -> dict[str, Any]:
    """One decode step on one random fill: logits through the coded cache as served (``backend``) and its
    reference path (``"torch"``), each against the model's own cache holding the decoded contents; then the
    per-site check (:class:`SiteCheckCache`: served against reference at every site, teacher-forced), whose
    logits must be the reference path's exactly."""
    gen = torch.Generator(device).manual_seed(seed)
    contents = random_contents(quantizer, serving, context, batch=batch, device=device, gen=gen)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device, generator=gen)
    _, want = decode_step(model, decoded_cache(quantizer, contents, serving), ids)
    out = {"context": context, "batch": batch, "method": quantizer.method}

    def filled(path: str) -> QuantizedLoopKVCache:
        return fill_cache(QuantizedLoopKVCache(quantizer, **dataclasses.asdict(serving), backend=path), **contents)

    logits = {}
    for path, name in ((backend, "served"), ("torch", "reference")):
        cache = filled(path)
        _, logits[name] = decode_step(model, cache, ids)
        diff = (logits[name].float() - want.float())
        out[f"{name}_max_abs_diff"] = float(diff.abs().max())
        out[f"{name}_relative_error"] = float(diff.norm() / want.float().norm())
        out[f"{name}_same_argmax"] = bool(torch.equal(logits[name].argmax(-1), want.argmax(-1)))
        if name == "served":
            out["served_path"] = "kernel" if cache.served_by_kernel else "reference"
    site = SiteCheckCache(filled(backend), filled("torch"))
    _, got = decode_step(model, site, ids)
    out.update(site.summary(), site_logits_are_reference=bool(torch.equal(got, logits["reference"])))
    return out


def bf16_bytes(kv: Any, context: int, batch: int) -> int:
    """Bytes of a bf16 cache of ``context`` tokens (keys and values at every site)."""
    return kv.num_sites * 2 * batch * context * kv.kv_heads * kv.head_dim * 2


def run_case(model: torch.nn.Module, cache_kind: str, quantizer: KVQuantizer | None, *, serving: Serving, context: int,
             batch: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Fill one cache at (context, batch), time its decode steps; "does not fit" / "out of memory" with the bytes."""
    kv = model.kv_layout()
    out: dict[str, Any] = {"context": context, "batch": batch, "cache": cache_kind}
    gen = torch.Generator(device).manual_seed(args.seed + context + batch)
    cuda = device.type == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()  # what earlier cases left in the allocator counts as free
    if cache_kind == "bf16":
        held = context + args.warmup + args.steps
        need = bf16_bytes(kv, held, batch) + bf16_bytes(kv, held, batch) // (2 * kv.num_sites)  # + one site's growth
        out["bf16_bytes"] = need
        free = torch.cuda.mem_get_info(device)[0] if cuda else None
        if free is not None and need + GiB > free:
            out.update(status="does not fit", free_bytes=free)
            return out
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        if cache_kind == "bf16":
            cache = bf16_cache(kv, context, batch, device=device, gen=gen)
        else:
            cache = fill_cache(QuantizedLoopKVCache(quantizer, **dataclasses.asdict(serving)),
                               **random_contents(quantizer, serving, context, batch=batch, device=device, gen=gen))
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device, generator=gen)
        ms = time_steps(model, cache, ids, warmup=args.warmup, steps=args.steps)
        out["cache_bytes"] = cache.nbytes()
        if cache_kind != "bf16":
            out["served_path"] = "kernel" if cache.served_by_kernel else "reference"
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
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ouro-1.4b", choices=["ouro-1.4b", "ouro-2.6b"])
    ap.add_argument("--checkpoint", type=Path, help="a model folder (make_random_checkpoint.py) instead of --model")
    ap.add_argument("--scale-down", type=int, default=1, help="divide --model's widths and layers (CPU tests)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--caches", nargs="+", default=["bf16", *METHODS], choices=["bf16", *METHODS])
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="timed steps (a multiple of --page-size counts the "
                    "page encodes in proportion)")
    ap.add_argument("--codebook-size", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--steps-per-block", type=int, default=4)
    ap.add_argument("--sink-tokens", type=int, default=8)
    ap.add_argument("--recent-window", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument("--check-context", type=int, default=1024, help="context of the logits check (0: none)")
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--check-kernel", default="auto", choices=[b.value for b in CACHE_CHOICES],
                    help="the served cache's backend in the checks (triton: also on CPU under TRITON_INTERPRET=1)")
    ap.add_argument("--checks-only", action="store_true", help="run the checks, no timed cases")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    ap.add_argument("--table-from", type=Path, help="print the markdown table of a saved result and exit")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())))
        return
    if args.out is None:
        ap.error("--out is required")
    device = torch.device(args.device)
    serving = Serving(args.sink_tokens, args.recent_window, args.page_size)
    model = build_model(args, device)
    kv = model.kv_layout()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or None
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "commit": commit, "command": " ".join(["python", "benchmarks/bench_decode_model.py", *sys.argv[1:]]),
        "model": str(args.checkpoint or args.model), "scale_down": args.scale_down,
        "kv": {"sites": kv.num_sites, "kv_heads": kv.kv_heads, "head_dim": kv.head_dim, "loop_steps": kv.loop_steps},
        "quantizer": {"codebook_size": args.codebook_size, "group_size": args.group_size,
                      "steps_per_block": args.steps_per_block}, "serving": dataclasses.asdict(serving),
        "warmup": args.warmup, "steps": args.steps, "check_kernel": args.check_kernel, "checks": [], "cases": []}
    quantizers = {m: synthetic_quantizer(kv, m, codebook_size=args.codebook_size, group_size=args.group_size,
                                         steps_per_block=args.steps_per_block, device=device, seed=args.seed)
                  for m in args.caches if m in METHODS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.check_context:
        for q in quantizers.values():
            result["checks"].append(check_fill(model, q, serving, context=args.check_context, batch=args.check_batch,
                                               device=device, seed=args.seed, backend=args.check_kernel))
            c = result["checks"][-1]
            print(json.dumps(c), flush=True)
            print(f"{c['method']}: per-site relative error (served by {c['site_served_path']}) max "
                  f"{c['site_relative_error_max']:.3g}, median {c['site_relative_error_median']:.3g}", flush=True)
            args.out.write_text(json.dumps(result, indent=1))
    for context in [] if args.checks_only else args.contexts:
        for batch in args.batches:
            for kind in args.caches:
                r = run_case(model, kind, quantizers.get(kind), serving=serving, context=context, batch=batch, args=args,
                             device=device)
                result["cases"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "step_ms"}), flush=True)
                args.out.write_text(json.dumps(result, indent=1))  # after every case: a cut-off run keeps its cases
    print(table(result))


def table(result: dict[str, Any]) -> str:
    """Markdown table of the cases: ms per step, tokens/s and speedup over bf16 at the same (context, batch)."""
    bf16 = {(r["context"], r["batch"]): r for r in result["cases"] if r["cache"] == "bf16" and r["status"] == "ok"}
    rows = ["| context | batch | cache | median ms/step | mean ms/step | tokens/s | speedup vs bf16 | peak GB |",
            "|---|---|---|---|---|---|---|---|"]
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
        rows.append(f"{head} {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['tokens_per_s']:.1f} | {speedup} | "
                    f"{peak} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
