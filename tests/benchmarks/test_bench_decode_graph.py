"""The CUDA-graph cases of benchmarks/decode/bench_decode_model.py (benchmarks/decode/decode_graph.py) at a tiny scale: the bf16
static baseline against the model's own cache, the kernel-modelled figures read from bench_decode.py's results,
graph cases run end to end (off CUDA their steps run eagerly through the same decoder), the profile on the GPU."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import load_script

from loopvq_calib.models import LoopKVCache
from loopvq_calib.serving.graph_decode import GraphDecoder

bdm = load_script("bench_decode_model")
dg = load_script("decode_graph")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ARGS = ["bench_decode_model.py", "--scale-down", "16", "--contexts", "90", "--batches", "2", "--warmup", "1",
        "--steps", "8", "--check-context", "0", "--device", str(DEVICE)]


@pytest.fixture(scope="module")
def tiny_model():
    from make_random_checkpoint import random_model  # on sys.path through the script

    return random_model("ouro-1.4b", str(DEVICE), seed=0, scale_down=16)


def test_bf16_static_baseline_is_the_models_own_cache(tiny_model):
    """Three decode steps through StaticBf16Cache (a capacity of 112 for 90 tokens, SDPA under its mask) give the
    logits of the model's own cache holding the same 90 tokens; the unused capacity is never attended."""
    kv = tiny_model.kv_layout()
    static = dg.StaticBf16Cache(kv, batch=2, length=90, max_length=100, device=DEVICE,
                                gen=torch.Generator(DEVICE).manual_seed(0))
    own = LoopKVCache()
    for site in static.keys:
        own.keys[site], own.values[site] = static.keys[site][:, :90].clone(), static.values[site][:, :90].clone()
        static.keys[site][:, 90:], static.values[site][:, 90:] = 1e3, -1e3  # garbage past the tokens held
    decoder = GraphDecoder(tiny_model, static, graphs=False)
    ids = torch.tensor([[5], [7]], device=DEVICE)
    with torch.inference_mode():
        for _ in range(3):
            want = tiny_model(ids, cache=own, use_cache=True).logits[:, -1]
            got = decoder.step(ids)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
            ids = want.argmax(-1, keepdim=True)
    assert static.length == own.get_seq_length() == 93 and static.keys[0].shape[1] == 112


def test_kernel_model_reads_bench_decode_results():
    """The stored kernel run: 32k x 8 LoopVQ is batch / (body + 96 sites x one site's attention), 419 tokens/s;
    a -graph cache reads its method's figure, bf16 the SDPA one; no file, no figures."""
    model = dg.kernel_model(bdm.KERNEL_MODEL)
    stored = json.loads(bdm.KERNEL_MODEL.read_text())
    case = next(c for c in stored["cases"] if (c["context"], c["batch"], c["method"]) == (32768, 8, "loopvq"))
    want = 8 / (stored["body_ms"]["8"] + 96 * case["coded_ms"]) * 1e3
    assert dg.modelled(model, 32768, 8, cache="loopvq-graph") == dg.modelled(model, 32768, 8, cache="loopvq") == \
        pytest.approx(want) == pytest.approx(419, abs=1)
    first = next(c for c in stored["cases"] if (c["context"], c["batch"]) == (32768, 8))
    assert dg.modelled(model, 32768, 8, cache="bf16-graph") == first["bf16_tokens_per_s"]
    assert dg.modelled(model, 90, 2, cache="loopvq") is None and dg.kernel_model(None) == {}


def test_graph_cases_run_and_are_set_against_the_model(tmp_path, monkeypatch, capsys):
    """loopvq-graph and bf16-graph cases beside the eager ones: timed steps, tokens/s = batch / mean step, the
    kernel-modelled figure of a given file and the printed ratio; on CUDA both kinds of graph captured."""
    figures = {"device": "X", "commit": "c", "cases": [
        {"context": 90, "batch": 2, "method": "loopvq", "coded_tokens_per_s": 50.0, "bf16_tokens_per_s": 40.0}]}
    (tmp_path / "k.json").write_text(json.dumps(figures))
    argv = [*ARGS, "--caches", "bf16-graph", "loopvq", "loopvq-graph", "--kernel-model", str(tmp_path / "k.json"),
            "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    bdm.main()
    result = json.loads((tmp_path / "r.json").read_text())
    printed = capsys.readouterr().out
    assert result["kernel_model"] == {"file": "k.json", "device": "X", "commit": "c"}
    assert [r["cache"] for r in result["cases"]] == ["bf16-graph", "loopvq", "loopvq-graph"]
    for r in result["cases"]:
        assert r["status"] == "ok" and len(r["step_ms"]) == 8
        assert r["tokens_per_s"] == pytest.approx(2 / (sum(r["step_ms"]) / 8) * 1e3)
        want = 40.0 if r["cache"] == "bf16-graph" else 50.0
        assert r["modelled_tokens_per_s"] == want
        assert f"90 x 2 {r['cache']}: {r['tokens_per_s']:.1f} tokens/s, " in printed
    graphs = {r["cache"]: r.get("graphs") for r in result["cases"]}
    assert graphs == ({"bf16-graph": 1, "loopvq": None, "loopvq-graph": 2} if DEVICE.type == "cuda" else
                      {"bf16-graph": 0, "loopvq": None, "loopvq-graph": 0})


@pytest.mark.gpu
def test_graph_cases_profile_their_kernels(tmp_path, monkeypatch):
    """--profile-steps at the case's (context, batch): the eager steps' kernel time by kind, the decode attention
    kernel among them; the replayed steps' wall time (and their kernels where the profiler sees inside graphs)."""
    argv = [*ARGS, "--caches", "loopvq-graph", "--profile-steps", "2", "--profile-at", "90", "2",
            "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", argv)
    bdm.main()
    case = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    replayed, eager = case["profile"]["replayed"], case["profile"]["eager"]
    assert replayed["steps"] == eager["steps"] == 2 and replayed["wall_ms"] > 0 and eager["kernel_ms"] > 0
    assert any(k.startswith("decode attention") for k in eager["by_kind_ms"]) and len(eager["top_kernels"]) <= 12


def test_speed_page_sets_graph_cases_against_eager_ones_and_the_model(tmp_path):
    """decode_speed_table's graph section: per (context, batch) eager and graph tokens/s of bf16 and each method, the
    method's kernel-modelled figure and the graph's share of it ("-" where a case is missing or did not fit); the
    profile's kernel time by kind; absent without the file."""
    ds = load_script("decode_speed_table")

    def case(context, batch, cache, tokens=None, **extra):
        return {"context": context, "batch": batch, "cache": cache, "status": "ok" if tokens else "does not fit",
                "tokens_per_s": tokens, "mean_ms": 20.0, **extra}

    profile = {"wall_ms": 21.0, "kernel_ms": 20.5, "by_kind_ms": {"decode attention (CUDA)": 14.5, "matmul": 6.0}}
    result = {"cases": [case(32768, 8, "bf16", bf16_bytes=207e9), case(32768, 8, "bf16-graph", bf16_bytes=207e9),
                        case(32768, 8, "loopvq", 120.0, modelled_tokens_per_s=419.0),
                        case(32768, 8, "loopvq-graph", 335.2, modelled_tokens_per_s=419.0,
                             profile={"replayed": profile, "eager": profile})],
              "kernel_model": {"file": "k.json", "device": "H", "commit": "c"}, "kv": {"sites": 96}, "device": "H",
              "torch": "t",
              "commit": "abc", "command": "python benchmarks/decode/bench_decode_model.py --caches loopvq-graph --out x.json"}
    lines = ds.graph_table(result)
    assert lines[0] == ("| context | batch | bf16 eager | bf16 graph | LoopVQ eager | LoopVQ graph | modelled | "
                        "graph / modelled |")
    assert lines[2:] == ["| 32,768 | 8 | does not fit (needs 207 GB) | does not fit (needs 207 GB) | 120.0 | 335.2 | "
                         "419.0 | 80% |"]
    limit, = ds.graph_limits(result)
    assert "(loopvq-graph, 32,768 x 8) takes 21.00 ms replayed (20.00 ms timed)" in limit
    assert "take 20.50 ms: decode attention (CUDA) 14.50, matmul 6.00 ms" in limit.replace("\n  ", " ")
    path = tmp_path / "bench-decode-graph-h200.json"
    assert ds.graph_section(path) == []
    path.write_text(json.dumps(result))
    section = "\n".join(ds.graph_section(path))
    assert section.startswith("## Whole-model decode, CUDA graphs") and lines[2] in section
    assert "graph + 96 x one site's decode attention), from `k.json` (H, commit `c`)" in section.replace("\n", " ")
    assert "--out benchmarks/results/bench-decode-graph-h200.json" in section.replace("\n", " ")
