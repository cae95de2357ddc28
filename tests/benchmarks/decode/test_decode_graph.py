"""benchmarks/decode/decode_graph.py, the CUDA-graph cases of bench_decode_model.py, at a tiny scale: the bf16 static
baseline against the model's own cache, the kernel-modelled figures read from bench_decode.py's stored results, the
profile on the GPU (graph cases run end to end: test_bench_decode_model.py)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from support.decode_bench import tiny_bench_args

from benchmarks.decode import bench_decode_model as bdm, decode_graph as dg
from loopvq_calib.models import LoopKVCache
from loopvq_calib.serving.graph_decode import GraphDecoder

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ARGS = tiny_bench_args(DEVICE)


@pytest.fixture(scope="module")
def tiny_model():
    from make_random_checkpoint import random_model  # on sys.path through the script

    return random_model("ouro-1.4b", str(DEVICE), seed=0, scale_down=16)


def test_bf16_static_baseline_is_the_models_own_cache(tiny_model):
    """Three decode steps through StaticBf16Cache (a capacity of 112 for 90 tokens, SDPA under its mask) give the
    logits of the model's own cache holding the same 90 tokens; the unused capacity is never attended."""
    kv = tiny_model.kv_layout()
    static = dg.StaticBf16Cache(
        kv, batch=2, length=90, max_length=100, device=DEVICE, gen=torch.Generator(DEVICE).manual_seed(0)
    )
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
    assert (
        dg.modelled(model, 32768, 8, cache="loopvq-graph")
        == dg.modelled(model, 32768, 8, cache="loopvq")
        == pytest.approx(want)
        == pytest.approx(419, abs=1)
    )
    first = next(c for c in stored["cases"] if (c["context"], c["batch"]) == (32768, 8))
    assert dg.modelled(model, 32768, 8, cache="bf16-graph") == first["bf16_tokens_per_s"]
    assert dg.modelled(model, 90, 2, cache="loopvq") is None and dg.kernel_model(None) == {}


@pytest.mark.gpu
def test_graph_cases_profile_their_kernels(tmp_path, monkeypatch):
    """--profile-steps at the case's (context, batch): the eager steps' kernel time by kind, the decode attention
    kernel among them; the replayed steps' wall time (and their kernels where the profiler sees inside graphs)."""
    argv = [
        *ARGS,
        "--check-context",
        "0",
        "--caches",
        "loopvq-graph",
        "--profile-steps",
        "2",
        "--profile-at",
        "90",
        "2",
        "--out",
        str(tmp_path / "r.json"),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    bdm.main()
    case = json.loads((tmp_path / "r.json").read_text())["cases"][0]
    replayed, eager = case["profile"]["replayed"], case["profile"]["eager"]
    assert replayed["steps"] == eager["steps"] == 2 and replayed["wall_ms"] > 0 and eager["kernel_ms"] > 0
    assert any(k.startswith("decode attention") for k in eager["by_kind_ms"]) and len(eager["top_kernels"]) <= 12
