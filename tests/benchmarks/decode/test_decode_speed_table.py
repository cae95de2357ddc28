"""benchmarks/decode/decode_speed_table.py: docs/decode-speed.md generated from the stored decode benchmark files, and
its tables and graph section on hand-made results."""

from __future__ import annotations

import json
import sys

from conftest import ROOT

from benchmarks.decode import decode_speed_table as ds


def test_the_committed_page_is_the_one_the_stored_results_give(tmp_path, monkeypatch):
    out = tmp_path / "decode-speed.md"
    monkeypatch.setattr(sys, "argv", ["decode_speed_table.py", "--write", str(out)])
    ds.main()
    assert out.read_text() == (ROOT / "docs" / "decode-speed.md").read_text()
    stored = json.loads(ds.KERNEL.read_text())
    case = next(c for c in stored["cases"] if (c["context"], c["batch"], c["method"]) == (32768, 8, "loopvq"))
    row = f"| 32,768 | 8 | {case['bf16_ms'] * 1e3:.1f} | {case['coded_ms'] * 1e3:.1f} | "
    assert row in out.read_text()  # the table shows the stored microseconds


def test_the_stored_command_is_rewritten_to_run_from_this_tree(tmp_path):
    path = tmp_path / "bench-decode-cuda-h200-run9.json"
    stored = {"command": "python scripts/bench_decode.py --commit 7862989 --out /root/out/bench.json --batches 1 8"}
    assert ds.reproduce(stored, path) == (
        "python benchmarks/decode/bench_decode.py --out "
        "benchmarks/results/bench-decode-cuda-h200-run9.json --batches 1 8"
    )
    flat = {"command": "python benchmarks/bench_decode_model.py --out x.json"}  # recorded before the topic folders
    assert ds.reproduce(flat, path).startswith("python benchmarks/decode/bench_decode_model.py --out ")
    checks = {"command": "python benchmarks/decode/bench_decode_model.py --checks-only --out x.json --commit abc"}
    assert ds.reproduce(checks, path).endswith(f"--checks-only --out benchmarks/results/{path.name}")


def _case(context: int, batch: int, method: str, coded_ms: float, bf16_ms: float) -> dict:
    return {"context": context, "batch": batch, "method": method, "coded_ms": coded_ms, "bf16_ms": bf16_ms}


def test_the_tables_give_each_method_its_time_its_ratio_and_say_when_bf16_does_not_fit():
    """One site's attention: each method's microseconds and ratio to SDPA, no cell for a method not run there; the
    whole model: tokens/s, speed-up and peak of each cache, "does not fit" with the bytes a bf16 cache needs."""
    result = {
        "cases": [
            _case(4096, 8, "loopvq", 0.02, 0.06),
            _case(4096, 8, "tasq+loopvq", 0.04, 0.06),
            _case(65536, 1, "loopvq", 0.05, 0.125),
        ]
    }
    lines = ds.attention_table(result)
    assert lines[0] == "| context | batch | bf16 SDPA us | LoopVQ us | speedup | TaSQ+LoopVQ us | speedup |"
    assert lines[2:] == [
        "| 4,096 | 8 | 60.0 | 20.0 | **3.00x** | 40.0 | **1.50x** |",
        "| 65,536 | 1 | 125.0 | 50.0 | **2.50x** | - | - |",
    ]  # a method not run there: no cell

    def case(context, batch, cache, tokens=None, **extra):
        ok = {"status": "ok", "tokens_per_s": tokens, "peak_bytes": 2e9} if tokens else {}
        return {"context": context, "batch": batch, "cache": cache, **ok, **extra}

    whole = {
        "cases": [
            case(4096, 1, "bf16", 12.0),
            case(4096, 1, "loopvq", 15.0),
            case(32768, 8, "bf16", status="does not fit", bf16_bytes=207.5e9, free_bytes=145e9),
            case(32768, 8, "loopvq", 120.0),
        ]
    }
    lines = ds.model_table(whole)
    assert lines[0] == "| context | batch | bf16 cache tokens/s | LoopVQ tokens/s | speedup | peak GB: bf16 | LoopVQ |"
    assert lines[2:] == [
        "| 4,096 | 1 | 12.0 | 15.0 | 1.25x | 2.0 | 2.0 |",
        "| 32,768 | 8 | does not fit (needs 208 GB) | 120.0 | - | - | 2.0 |",
    ]


def test_the_graph_section_sets_graph_cases_against_eager_ones_and_the_model(tmp_path):
    """decode_speed_table's graph section: per (context, batch) eager and graph tokens/s of bf16 and each method, the
    method's kernel-modelled figure and the graph's share of it ("-" where a case is missing or did not fit); the
    profile's kernel time by kind; absent without the file."""

    def case(context, batch, cache, tokens=None, **extra):
        return {
            "context": context,
            "batch": batch,
            "cache": cache,
            "status": "ok" if tokens else "does not fit",
            "tokens_per_s": tokens,
            "mean_ms": 20.0,
            **extra,
        }

    profile = {"wall_ms": 21.0, "kernel_ms": 20.5, "by_kind_ms": {"decode attention (CUDA)": 14.5, "matmul": 6.0}}
    result = {
        "cases": [
            case(32768, 8, "bf16", bf16_bytes=207e9),
            case(32768, 8, "bf16-graph", bf16_bytes=207e9),
            case(32768, 8, "loopvq", 120.0, modelled_tokens_per_s=419.0),
            case(
                32768,
                8,
                "loopvq-graph",
                335.2,
                modelled_tokens_per_s=419.0,
                profile={"replayed": profile, "eager": profile},
            ),
        ],
        "kernel_model": {"file": "k.json", "device": "H", "commit": "c"},
        "kv": {"sites": 96},
        "device": "H",
        "torch": "t",
        "commit": "abc",
        "command": "python benchmarks/decode/bench_decode_model.py --caches loopvq-graph --out x.json",
    }
    lines = ds.graph_table(result)
    assert lines[0] == (
        "| context | batch | bf16 eager | bf16 graph | LoopVQ eager | LoopVQ graph | modelled | graph / modelled |"
    )
    assert lines[2:] == [
        ("| 32,768 | 8 | does not fit (needs 207 GB) | does not fit (needs 207 GB) | 120.0 | 335.2 | 419.0 | 80% |")
    ]
    (limit,) = ds.graph_limits(result)
    assert "(loopvq-graph, 32,768 x 8) takes 21.00 ms replayed (20.00 ms timed)" in limit
    assert "take 20.50 ms: decode attention (CUDA) 14.50, matmul 6.00 ms" in limit.replace("\n  ", " ")
    path = tmp_path / "bench-decode-graph-h200.json"
    assert ds.graph_section(path) == []
    path.write_text(json.dumps(result))
    section = "\n".join(ds.graph_section(path))
    assert section.startswith("## Whole-model decode, CUDA graphs") and lines[2] in section
    assert "graph + 96 x one site's decode attention), from `k.json` (H, commit `c`)" in section.replace("\n", " ")
    assert "--out benchmarks/results/bench-decode-graph-h200.json" in section.replace("\n", " ")
