"""benchmarks/decode/measure_cache_bytes.py: the bytes per token held by the quantized KV cache against a bf16 cache.

Prefills held-out text of each length, decodes a few tokens greedily through explicit forward calls,
and prints QuantizedLoopKVCache.bytes_per_token() as a markdown table. Without --bundle the quantizer's
codebooks are random group vectors of the text (sampled_quantizer): byte counts depend only on the
layout (K, G, T_c, TaSQ), not on the codebook values.

    python benchmarks/decode/measure_cache_bytes.py                      # reference model, bf16, LoopVQ 0.5 bit
    python benchmarks/decode/measure_cache_bytes.py --bundle runs/x/bundle --model artifacts/tiny-ouro
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: local models and data only
sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

import torch

from benchmarks.common.paths import ROOT
from benchmarks.common.quantizers import sampled_quantizer
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.models.loading import load_model
from loopvq_calib.serving.cache import QuantizedLoopKVCache


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "artifacts" / "tiny-ouro"))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--bundle", help="measure with this bundle's quantizer (default: a sampled one)")
    p.add_argument("--method", default="loopvq", help="sampled quantizer: cq | tasq | loopvq | tasq+loopvq")
    p.add_argument("--codebook-size", type=int, default=256)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--sink-tokens", type=int, default=8)
    p.add_argument("--recent-window", type=int, default=64)
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2000], help="prompt lengths")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--text", default=str(ROOT / "artifacts" / "data" / "shakespeare-heldout.jsonl"))
    args = p.parse_args(argv)
    model, tok = load_model(Path(args.model), args.dtype, torch.device("cpu"))
    docs = [json.loads(line)["text"] for line in Path(args.text).read_text().splitlines() if line.strip()]
    stream = torch.tensor([tok("\n".join(docs))["input_ids"]])
    if args.bundle:
        quantizer = load_bundle(args.bundle).quantizer
    else:
        quantizer = sampled_quantizer(
            model,
            stream[:, :512],
            args.method,
            codebook_size=args.codebook_size,
            group_size=args.group_size,
            steps_per_block=args.steps_per_block,
        )
    kv = quantizer.kv
    print(
        f"model {args.model} ({args.dtype}); quantizer {quantizer.method}, K={quantizer.codebook_size}, "
        f"G={quantizer.group_size}, T_c={quantizer.steps_per_block}, bits {quantizer.bits()}; "
        f"{kv.num_sites} KV sites x {kv.kv_heads} heads x {kv.head_dim}; sinks {args.sink_tokens}, "
        f"window {args.recent_window}, page {args.page_size}\n"
    )
    print(
        "| tokens | sink / encoded / window | cache bytes | bytes per token | encoded bytes per token | "
        "bf16 bytes per token | ratio to bf16 |"
    )
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        cache = QuantizedLoopKVCache(quantizer, args.sink_tokens, args.recent_window, page_size=args.page_size)
        with torch.no_grad():
            out = model(stream[:, :length], cache=cache, use_cache=True)
            for _ in range(args.new_tokens):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
        r = cache.bytes_per_token()
        enc = r["encoded_bytes_per_token"]
        print(
            f"| {r['tokens']} | {r['sink']} / {r['encoded']} / {r['window']} | {r['cache_bytes']:,} | "
            f"{r['bytes_per_token']:.1f} | {enc if enc is None else f'{enc:.0f}'} | {r['bf16_bytes_per_token']} | "
            f"{r['ratio_to_bf16']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
