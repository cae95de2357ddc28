"""benchmarks/decode/bench_decode_model.py at a tiny scale (Ouro-1.4B scaled down 16x: 1 layer x 4 loops, one KV head
of 128): one run of every kind of case (eager and CUDA-graph, bf16 and each method) and the checks, read against
tokens/s = batch / mean step and the kernel-modelled figures given; that the synthetic fill is what the coded cache
serves; the per-site check; fill_cache against a prefill."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, make_tiny_ouro
from support.decode_bench import tiny_bench_args
from support.quantizers import sampled_quantizer

from benchmarks.decode import bench_decode_model as bdm, decode_checks, decode_fill, site_check
from loopvq_calib.codes.codec import Codes
from loopvq_calib.codes.layouts import channel_sets
from loopvq_calib.serving.cache import QuantizedLoopKVCache

SCRIPT = ROOT / "benchmarks" / "decode" / "bench_decode_model.py"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ARGS = tiny_bench_args(DEVICE)
CACHES = ["bf16", "loopvq", "tasq+loopvq", "tasq+loopvq-channels", "bf16-graph", "loopvq-graph"]
FIGURES = {"loopvq": 50.0, "bf16": 40.0}  # the kernel-modelled tokens/s given at (90, 2)


def main(argv: list[str]) -> str:
    """The script's main with ``argv``; what it printed."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(sys, "argv", argv)
        bdm.main()
    return printed.getvalue()


@pytest.fixture(scope="module")
def tiny_model():
    from make_random_checkpoint import random_model  # on sys.path through the script

    return random_model("ouro-1.4b", str(DEVICE), seed=0, scale_down=16)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, str, str]:
    """One run of every kind of case at (90, 2), 8 timed steps, and the checks at 80 tokens: (the JSON written,
    what it printed, what --table-from prints)."""
    tmp = tmp_path_factory.mktemp("bench")
    figures = {
        "device": "X",
        "commit": "c",
        "cases": [
            {
                "context": 90,
                "batch": 2,
                "method": "loopvq",
                "coded_tokens_per_s": FIGURES["loopvq"],
                "bf16_tokens_per_s": FIGURES["bf16"],
            }
        ],
    }
    (tmp / "k.json").write_text(json.dumps(figures))
    printed = main(
        [
            *ARGS,
            "--check-context",
            "80",
            "--caches",
            *CACHES,
            "--kernel-model",
            str(tmp / "k.json"),
            "--out",
            str(tmp / "r.json"),
        ]
    )
    table = main(["bench_decode_model.py", "--table-from", str(tmp / "r.json")])
    return json.loads((tmp / "r.json").read_text()), printed, table


def test_every_case_is_timed_and_set_against_bf16_and_the_modelled_figure(run):
    """Each case: 8 timed steps (one page encoded on the way), tokens/s = batch / mean step, the median of the
    steps; a coded cache's bytes below a bf16 cache's; the figure of the kernel model given (none for a method it
    lacks) and the printed ratio; on CUDA both kinds of graph captured (off CUDA graph steps run eagerly)."""
    result, printed, table = run
    assert result["command"].startswith("python benchmarks/decode/bench_decode_model.py --scale-down 16")
    assert "commit" in result and result["kv"] == {"sites": 4, "kv_heads": 1, "head_dim": 128, "loop_steps": 4}
    assert result["kernel_model"] == {"file": "k.json", "device": "X", "commit": "c"}
    assert [(r["context"], r["batch"], r["cache"]) for r in result["cases"]] == [(90, 2, c) for c in CACHES]
    for r in result["cases"]:
        assert r["status"] == "ok" and len(r["step_ms"]) == 8 and min(r["step_ms"]) > 0
        assert r["tokens_per_s"] == pytest.approx(2 / statistics.fmean(r["step_ms"]) * 1e3)
        assert r["median_ms"] == pytest.approx(statistics.median(r["step_ms"]))
        assert r.get("modelled_tokens_per_s") == FIGURES.get(r["cache"].removesuffix("-graph"))
        if "modelled_tokens_per_s" in r:
            assert f"90 x 2 {r['cache']}: {r['tokens_per_s']:.1f} tokens/s, " in printed
        if not r["cache"].startswith("bf16"):
            assert r["served_path"] == ("kernel" if DEVICE.type == "cuda" else "reference")
            assert r["cache_bytes"] < 2 * 99 * 4 * 2 * 128 * 2  # codes: below a bf16 cache of 90 + 9 tokens
    graphs = {r["cache"]: r.get("graphs") for r in result["cases"] if r["cache"].endswith("-graph")}
    assert graphs == (
        {"bf16-graph": 1, "loopvq-graph": 2} if DEVICE.type == "cuda" else {"bf16-graph": 0, "loopvq-graph": 0}
    )
    assert table.strip() in printed and table.strip().count("\n") == 1 + len(CACHES)  # a row per case


def test_the_check_sees_the_decoded_fill_through_the_coded_cache(run):
    """Per method, one decode step's logits through the coded cache equal the model's own cache holding the decoded
    fill (exactly on CPU, where the served path is the reference one); the per-site errors, one per KV site."""
    result, _, _ = run
    assert [c["method"] for c in result["checks"]] == ["loopvq", "tasq+loopvq", "tasq+loopvq-channels"]
    for c in result["checks"]:
        assert c["served_same_argmax"] and c["reference_same_argmax"] and c["site_logits_are_reference"]
        errors = c["site_relative_errors"]
        assert len(errors) == 4 and c["site_relative_error_max"] == max(errors)
        assert c["site_relative_error_median"] == pytest.approx(statistics.median(errors))
        if DEVICE.type == "cpu":
            assert c["served_max_abs_diff"] == c["reference_max_abs_diff"] == 0.0
            assert c["site_served_path"] == "reference" and errors == [0.0] * 4
        else:
            assert c["served_relative_error"] < 2e-2 and c["reference_relative_error"] < 2e-2
            assert c["site_served_path"] == c["served_path"] == "kernel" and 0 < max(errors) < 2e-2


def test_random_fill_is_what_the_cache_serves_and_the_check_sees_a_wrong_one(tiny_model):
    """The fill's regions match a prefill of the same length (sinks, whole pages, a window in [recent, recent +
    page)); one decode step through the filled cache equals the decoded reference, and differs from a reference
    whose pages are put in another order."""
    serving = bdm.Serving(sink_tokens=8, recent_window=16, page_size=8)
    kv = tiny_model.kv_layout()
    q = bdm.synthetic_quantizer(kv, "tasq+loopvq", codebook_size=256, group_size=16, steps_per_block=4, device=DEVICE)
    assert q.codecs["key.b0.l0"].layout.groups.shape == (1, 32, 16)  # one head: a per-head permutation of 512
    assert sorted(q.codecs["key.b0.l0"].layout.groups.flatten().tolist()) == list(range(512))
    gen = torch.Generator(DEVICE).manual_seed(0)
    contents = bdm.random_contents(q, serving, 75, batch=2, device=DEVICE, gen=gen)
    cache = bdm.fill_cache(QuantizedLoopKVCache(q, **dataclasses.asdict(serving), backend="torch"), **contents)
    assert cache.regions() == {"sink": 8, "encoded": 48, "window": 19} and cache.get_seq_length() == 75
    ids = torch.randint(0, 4096, (2, 1), device=DEVICE, generator=gen)
    with torch.inference_mode():
        _, got = decode_checks.decode_step(tiny_model, cache, ids)
        _, want = decode_checks.decode_step(tiny_model, decode_fill.decoded_cache(q, contents, serving), ids)
        swapped = {**contents, "codes": {n: p[::-1] for n, p in contents["codes"].items()}}
        _, other = decode_checks.decode_step(tiny_model, decode_fill.decoded_cache(q, swapped, serving), ids)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (other.float() - want.float()).abs().max() > 10 * (got.float() - want.float()).abs().max()
    page = contents["codes"]["value.b0.l0"][0]
    assert isinstance(page, Codes) and page.indices.shape == (2 * 8, 1, 32) and page.sigma is None


def test_synthetic_quantizer_keys_follow_the_grouping(tiny_model):
    """``tasq+loopvq-channels`` gives key layouts of the ``channels`` grouping (the test serving and the bundle
    writer use), each a permutation of the block's coordinates; plain ``tasq+loopvq`` gives a free one."""
    kv = tiny_model.kv_layout()
    for method, channels in (("tasq+loopvq", False), ("tasq+loopvq-channels", True)):
        q = bdm.synthetic_quantizer(kv, method, codebook_size=256, group_size=16, steps_per_block=4, device=DEVICE)
        assert q.method == "tasq+loopvq"
        layout = q.codecs["key.b0.l0"].layout
        assert sorted(layout.groups.flatten().tolist()) == list(range(4 * kv.head_dim))
        sets = channel_sets(layout, kv.rope_style)
        assert (sets is not None) == channels
        if channels:  # 4 channels per code (two RoPE pairs), the same at every step
            assert sets.shape == (1, 32, 4)
            assert sorted(sets.flatten().tolist()) == list(range(kv.head_dim))


class DoubledValues(QuantizedLoopKVCache):
    """A served cache that is wrong by a known amount: its values doubled, so its attention output is exactly twice
    the reference's (relative error 1)."""

    def update(self, *args, **kwargs):
        k, v = super().update(*args, **kwargs)
        return k, 2 * v


def test_site_check_follows_the_reference_and_measures_each_site(tiny_model):
    """The per-site check's logits are a plain reference-cache decode's, bit for bit, whatever the served cache
    returns (teacher forcing); one error per KV site in site order: 0 when served is the reference path (both
    ``backend="torch"``), exactly 1 at every site when served doubles the values (not compounded over sites)."""
    serving = bdm.Serving(sink_tokens=8, recent_window=16, page_size=8)
    q = bdm.synthetic_quantizer(
        tiny_model.kv_layout(), "loopvq", codebook_size=256, group_size=16, steps_per_block=4, device=DEVICE
    )
    contents = bdm.random_contents(q, serving, 75, batch=2, device=DEVICE, gen=torch.Generator(DEVICE).manual_seed(1))
    ids = torch.randint(0, 4096, (2, 1), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))

    def filled(cls):
        return bdm.fill_cache(cls(q, **dataclasses.asdict(serving), backend="torch"), **contents)

    with torch.inference_mode():
        _, want = decode_checks.decode_step(tiny_model, filled(QuantizedLoopKVCache), ids)
    for served_cls, expect in ((QuantizedLoopKVCache, 0.0), (DoubledValues, 1.0)):
        site = site_check.SiteCheckCache(filled(served_cls), filled(QuantizedLoopKVCache))
        with torch.inference_mode():
            _, got = decode_checks.decode_step(tiny_model, site, ids)
        assert torch.equal(got, want)
        assert site.sites == [0, 1, 2, 3] and site.get_seq_length() == 76  # the reference cache's, one token on
        summary = site.summary()
        assert summary["site_served_path"] == "reference"
        assert summary["site_relative_errors"] == pytest.approx([expect] * 4, abs=1e-6)
        assert summary["site_relative_error_max"] == summary["site_relative_error_median"] == pytest.approx(expect)


def test_site_check_through_the_triton_kernel(tmp_path):
    """--checks-only --check-kernel triton (Triton's interpreter on CPU, in a child process since
    TRITON_INTERPRET=1 must precede the import of triton; the GPU as it is): the served path is the kernel,
    each site's error small but not zero (fp16 step tables, bf16 output: about 4e-3 in the interpreter), the
    check's logits the reference path's; no timed case. Run by path from another folder, as a user would."""
    pytest.importorskip("triton")
    env = dict(os.environ)  # the script puts the checkout on sys.path itself
    if DEVICE.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "c.json"
    argv = [
        sys.executable,
        str(SCRIPT),
        "--scale-down",
        "16",
        "--check-context",
        "80",
        "--checks-only",
        "--caches",
        "loopvq",
        "tasq+loopvq",
        "--check-kernel",
        "triton",
        "--device",
        str(DEVICE),
        "--out",
        str(out),
    ]
    code = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/", check=False)
    assert code.returncode == 0, code.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cases"] == [] and result["check_kernel"] == "triton"
    assert [c["method"] for c in result["checks"]] == ["loopvq", "tasq+loopvq"]  # the two kernel paths
    for c in result["checks"]:
        assert c["site_served_path"] == c["served_path"] == "kernel" and c["site_logits_are_reference"]
        assert len(c["site_relative_errors"]) == 4 and 1e-4 < min(c["site_relative_errors"])
        assert c["site_relative_error_max"] < (1e-2 if DEVICE.type == "cpu" else 2e-2)  # GPU: the CUDA kernel
        assert f"{c['method']}: per-site relative error (served by kernel) max" in code.stdout


def test_fill_gives_the_state_a_prefill_leaves():
    """A fresh cache filled with a prefilled cache's sinks/window, positions and pages decodes the same logits at
    every following step (pages encoded on the way), with the same regions; a used cache, missing sites, uneven
    pages or tokens that do not add up to the positions are refused."""
    model = make_tiny_ouro()
    prompt = torch.randint(0, 4096, (2, 37), generator=torch.Generator().manual_seed(5))
    q = sampled_quantizer(model, prompt, "tasq+loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    serving = {"sink_tokens": 4, "recent_window": 8, "page_size": 8}
    prefilled = QuantizedLoopKVCache(q, **serving)
    out = model(prompt, cache=prefilled, use_cache=True)
    positions = prefilled.positions[min(prefilled.positions)]
    state = {
        "keys": dict(prefilled.keys),
        "values": dict(prefilled.values),
        "positions": positions,
        "codes": {name: list(pages) for name, pages in prefilled.codes.items()},
    }
    filled = bdm.fill_cache(QuantizedLoopKVCache(q, **serving), **state)
    assert filled.regions() == prefilled.regions() == {"sink": 4, "encoded": 24, "window": 9}
    ids = out.logits[:, -1:].argmax(-1)
    for _ in range(9):  # one more page encoded in both
        a, b = (model(ids, cache=c, use_cache=True).logits[:, -1] for c in (prefilled, filled))
        assert torch.equal(a, b)
        ids = a[:, None].argmax(-1)
    assert filled.regions() == prefilled.regions() and filled.encoded == 32
    with pytest.raises(ValueError, match="fill_cache needs an empty cache"):
        bdm.fill_cache(filled, **state)
    with pytest.raises(ValueError, match="every KV site"):
        bdm.fill_cache(QuantizedLoopKVCache(q, **serving), **{**state, "keys": {0: state["keys"][0]}})
    uneven = {**state["codes"], next(iter(state["codes"])): state["codes"][next(iter(state["codes"]))][:1]}
    with pytest.raises(ValueError, match="same number of pages"):
        bdm.fill_cache(QuantizedLoopKVCache(q, **serving), **{**state, "codes": uneven})
    with pytest.raises(ValueError, match="do not make the 36 positions"):
        bdm.fill_cache(QuantizedLoopKVCache(q, **serving), **{**state, "positions": positions[:, 1:]})


def test_bf16_bytes_at_ouro_shapes():
    """96 sites x (K, V) x 16 heads x 128 x 2 bytes = 786,432 bytes per token: 32k x 8 is 206 GB."""
    kv = type("KV", (), {"num_sites": 96, "kv_heads": 16, "head_dim": 128})()
    assert bdm.bf16_bytes(kv, 32768, 8) == 786_432 * 32768 * 8 == 206_158_430_208
