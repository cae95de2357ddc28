"""Time one fine-tuning step and its parts at real model shapes (random bf16 weights, random codebooks),
and its peak GPU memory with and without ``finetune.loop_checkpointing``. Prints one JSON line per
configuration; with --profile also writes the torch.profiler table of the last step (CUDA time by op).
Used for the fine-tuning analysis in docs/performance.md and the 80 GB check of docs/finetune.md.

    python scripts/probe_finetune_step.py --model ouro-1.4b --profile probe.txt
    python scripts/probe_finetune_step.py --model huginn-3.5b --loop-checkpointing both
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_checkpoint import MODELS, frozen_random_model  # noqa: E402

from loopvq_calib.codes.codec import BlockCodec, TasqTransform  # noqa: E402
from loopvq_calib.codes.layouts import codebook_shape, plan_layouts  # noqa: E402
from loopvq_calib.codes.objective import mean_kl, quantized_logits, teacher  # noqa: E402
from loopvq_calib.codes.quantizer import KVQuantizer  # noqa: E402
from loopvq_calib.config.load import load_config  # noqa: E402
from loopvq_calib.models.sites import loop_checkpointing  # noqa: E402


def random_quantizer(model: torch.nn.Module, quant, device: torch.device) -> KVQuantizer:
    """Codebooks of the method's layouts with random values (timing does not depend on them); TaSQ methods
    get random channel weights and a random permutation of each head's key coordinates into groups."""
    kv = model.kv_layout()
    gen = torch.Generator().manual_seed(0)
    codecs = {}
    for lay in plan_layouts(kv, quant):
        transform = None
        if quant.uses_tasq and lay.kind == "key":
            coords = lay.steps * lay.head_dim
            lay.groups = torch.stack([torch.randperm(coords, generator=gen) for _ in range(lay.kv_heads)]).view(
                lay.kv_heads, -1, quant.group_size)
            transform = TasqTransform((torch.rand(lay.steps, lay.kv_heads, lay.head_dim, generator=gen) + 0.5).to(device))
        codebook = torch.randn(codebook_shape(lay, quant.codebook_size, quant.codebook_sharing), generator=gen)
        codecs[lay.key] = BlockCodec(lay, codebook.to(device), transform)
    return KVQuantizer(codecs=codecs, method=quant.method, codebook_size=quant.codebook_size, group_size=quant.group_size,
                       steps_per_block=quant.block_steps, sharing=quant.codebook_sharing, kv=kv)


def timed(fn, sync):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def one_step(model, ids, quantizer, params, sinks: int) -> dict[str, float]:
    """teacher forward -> encode/decode of every site -> quantized forward -> KL -> backward, timed apart."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    times = {}
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.is_cuda):
        fp, times["teacher_s"] = timed(lambda: teacher(model, ids), sync)
        dtype = next(iter(fp.keys.values())).dtype  # as quantized_logits: each block cast once to the forward's dtype
        q, times["encode_decode_s"] = timed(lambda: quantizer.quantize_sites(fp.keys, fp.values, dtype), sync)
        logits, times["quantized_forward_s"] = timed(lambda: quantized_logits(model, ids, quantizer, fp=fp, sink_tokens=sinks, quantized=q), sync)
    kl, times["kl_s"] = timed(lambda: mean_kl(fp.logits, logits, sinks), sync)
    _, times["backward_s"] = timed(kl.backward, sync)
    for p in params:
        p.grad = None
    times["step_s"] = sum(times.values())
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="ouro-1.4b")
    ap.add_argument("--method", default="loopvq", choices=["cq", "loopvq", "tasq+loopvq"])
    ap.add_argument("--bits", type=float, default=0.5, choices=[0.5, 0.25])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--scale-down", type=int, default=1, help="divide widths and layers by this (CPU dry runs)")
    ap.add_argument("--steps", type=int, default=3,
                    help="steps per configuration; each part's minimum over them is reported, and the fastest whole step")
    ap.add_argument("--loop-checkpointing", choices=["off", "on", "both"], default="off")
    ap.add_argument("--profile", default=None, help="write the profiler table of the last step here")
    args = ap.parse_args()
    model, device = frozen_random_model(args.model, args.scale_down)
    quant = load_config({"quant": {"method": args.method, "bits": args.bits, "group_size": 16 if args.bits == 0.5 else 32}}).quant
    quantizer = random_quantizer(model, quant, device)
    params = [torch.nn.Parameter(c.codebook) for c in quantizer.codecs.values()]
    for c, p in zip(quantizer.codecs.values(), params):
        c.codebook = p
    ids = torch.randint(3, model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    for ckpt in {"off": [False], "on": [True], "both": [False, True]}[args.loop_checkpointing]:
        with loop_checkpointing(model, ckpt):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            try:
                runs = [one_step(model, ids, quantizer, params, 8) for _ in range(args.steps)]
                best = {k: round(min(r[k] for r in runs), 4) for k in runs[0]}
            except torch.OutOfMemoryError:
                best = {"out_of_memory": True}
                for p in params:
                    p.grad = None
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            print(json.dumps({"model": args.model, "method": args.method, "bits": args.bits, "seq_len": args.seq_len,
                              "loop_checkpointing": ckpt, "best_of": args.steps, **best,
                              "peak_gpu_gib": round(peak, 2) if peak else None,
                              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof, loop_checkpointing(model, ckpt):
            one_step(model, ids, quantizer, params, 8)
        key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
        Path(args.profile).write_text(prof.key_averages().table(sort_by=key, row_limit=40))


if __name__ == "__main__":
    main()
