"""Serving speed and size: one KV site's decode attention from codes (bench_decode.py and its parts
bench_decode_shapes.py, bench_decode_launches.py, bench_decode_tables.py), whole-model greedy decode through the served
cache, eager and from CUDA graphs, with its checks (bench_decode_model.py and its parts decode_fill.py, decode_graph.py,
site_check.py, decode_checks.py, bench_decode_model_tables.py), the cache's bytes per token (measure_cache_bytes.py)
and docs/decode-speed.md from the stored results (decode_speed_table.py)."""
