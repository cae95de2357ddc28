"""The shapes benchmarks/decode/bench_decode.py measures at and its tables count with: Ouro-1.4B (24 layers x 4 loop
steps = 96 KV sites, 16 query and 16 KV heads, head dim 128; its weights' widths and RoPE base), the 0.5-bit codes
(LoopVQ K 256, G 16, T_c 4) and the served cache's 8 sinks + 68 window tokens in bf16."""

from __future__ import annotations

LAYERS, STEPS, HEADS, KV_HEADS, D = 24, 4, 16, 16, 128
HIDDEN, INTER, VOCAB, THETA = 2048, 5632, 49152, 1_000_000.0
K, G, T_C = 256, 16, 4
SINKS, WINDOW = 8, 68
SITES = LAYERS * STEPS
WEIGHT_BYTES = 2 * (LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER) + 2 * VOCAB * HIDDEN)
