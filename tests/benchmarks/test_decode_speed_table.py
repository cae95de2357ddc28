"""benchmarks/decode/decode_speed_table.py: docs/decode-speed.md generated from the stored decode benchmark files."""

from __future__ import annotations

import json
import sys

from conftest import ROOT, load_script

ds = load_script("decode_speed_table")


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
    assert ds.reproduce(stored, path) == ("python benchmarks/decode/bench_decode.py --out "
                                          "benchmarks/results/bench-decode-cuda-h200-run9.json --batches 1 8")
    checks = {"command": "python benchmarks/decode/bench_decode_model.py --checks-only --out x.json --commit abc"}
    assert ds.reproduce(checks, path).endswith(f"--checks-only --out benchmarks/results/{path.name}")


def _case(context: int, batch: int, method: str, coded_ms: float, bf16_ms: float) -> dict:
    return {"context": context, "batch": batch, "method": method, "coded_ms": coded_ms, "bf16_ms": bf16_ms}


def test_attention_rows_give_each_method_its_time_and_its_ratio_to_sdpa():
    result = {"cases": [_case(4096, 8, "loopvq", 0.02, 0.06), _case(4096, 8, "tasq+loopvq", 0.04, 0.06),
                        _case(65536, 1, "loopvq", 0.05, 0.125)]}
    lines = ds.attention_table(result)
    assert lines[0] == "| context | batch | bf16 SDPA us | LoopVQ us | speedup | TaSQ+LoopVQ us | speedup |"
    assert lines[2:] == ["| 4,096 | 8 | 60.0 | 20.0 | **3.00x** | 40.0 | **1.50x** |",
                         "| 65,536 | 1 | 125.0 | 50.0 | **2.50x** | - | - |"]  # a method not run there: no cell


def test_whole_model_rows_say_when_bf16_does_not_fit():
    def case(context, batch, cache, tokens=None, **extra):
        ok = {"status": "ok", "tokens_per_s": tokens, "peak_bytes": 2e9} if tokens else {}
        return {"context": context, "batch": batch, "cache": cache, **ok, **extra}

    result = {"cases": [case(4096, 1, "bf16", 12.0), case(4096, 1, "loopvq", 15.0),
                        case(32768, 8, "bf16", status="does not fit", bf16_bytes=207.5e9, free_bytes=145e9),
                        case(32768, 8, "loopvq", 120.0)]}
    lines = ds.model_table(result)
    assert lines[0] == "| context | batch | bf16 cache tokens/s | LoopVQ tokens/s | speedup | peak GB: bf16 | LoopVQ |"
    assert lines[2:] == ["| 4,096 | 1 | 12.0 | 15.0 | 1.25x | 2.0 | 2.0 |",
                         "| 32,768 | 8 | does not fit (needs 208 GB) | 120.0 | - | - | 2.0 |"]
