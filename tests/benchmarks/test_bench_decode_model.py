"""benchmarks/decode/bench_decode_model.py at a tiny scale (Ouro-1.4B scaled down 16x: 1 layer x 4 loops, one KV head of 128):
the JSON it writes, its table, that the synthetic fill is what the coded cache serves, and fill_cache against a
prefill."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_script, make_tiny_ouro
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.codec import Codes
from loopvq_calib.codes.layouts import channel_sets
from loopvq_calib.serving.cache import QuantizedLoopKVCache

SCRIPT = ROOT / "benchmarks" / "bench_decode_model.py"
bdm = load_script("bench_decode_model")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def tiny_model():
    from make_random_checkpoint import random_model  # on sys.path through the script

    return random_model("ouro-1.4b", str(DEVICE), seed=0, scale_down=16)


def run_script(monkeypatch, out: Path, *extra: str) -> dict:
    argv = ["bench_decode_model.py", "--scale-down", "16", "--contexts", "90", "--batches", "1", "2", "--warmup", "1",
            "--steps", "8", "--check-context", "80", "--device", str(DEVICE), "--out", str(out), *extra]
    monkeypatch.setattr(sys, "argv", argv)
    bdm.main()
    return json.loads(out.read_text())


def test_script_writes_every_case_and_the_fill_check(tmp_path, monkeypatch, capsys):
    """Every (context, batch, cache) case is timed (8 steps, one page encoded on the way), tokens/s = batch / mean
    step; the check's logits through the coded cache equal the model's own cache holding the decoded fill (exactly
    on CPU, where the served path is the reference one); --table-from prints the same table."""
    result = run_script(monkeypatch, tmp_path / "r.json")
    printed = capsys.readouterr().out
    assert result["command"].startswith("python benchmarks/decode/bench_decode_model.py --scale-down 16")
    assert "commit" in result and result["kv"] == {"sites": 4, "kv_heads": 1, "head_dim": 128, "loop_steps": 4}
    assert [(r["context"], r["batch"], r["cache"]) for r in result["cases"]] == [
        (90, b, c) for b in (1, 2) for c in ("bf16", "loopvq", "tasq+loopvq", "tasq+loopvq-channels")]
    for r in result["cases"]:
        assert r["status"] == "ok" and len(r["step_ms"]) == 8 and min(r["step_ms"]) > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (sum(r["step_ms"]) / 8) * 1e3)
        assert r["median_ms"] == pytest.approx(sorted(r["step_ms"])[3:5][0] / 2 + sorted(r["step_ms"])[3:5][1] / 2)
        if r["cache"] != "bf16":
            assert r["served_path"] == ("kernel" if DEVICE.type == "cuda" else "reference")
            assert r["cache_bytes"] < r["batch"] * 99 * 4 * 2 * 128 * 2  # codes: below a bf16 cache of 90 + 9 tokens
    assert [c["method"] for c in result["checks"]] == ["loopvq", "tasq+loopvq", "tasq+loopvq-channels"]
    for c in result["checks"]:
        assert c["served_same_argmax"] and c["reference_same_argmax"] and c["site_logits_are_reference"]
        errors = c["site_relative_errors"]
        assert len(errors) == 4 and c["site_relative_error_max"] == max(errors)
        assert c["site_relative_error_median"] == pytest.approx(sum(sorted(errors)[1:3]) / 2)
        if DEVICE.type == "cpu":
            assert c["served_max_abs_diff"] == c["reference_max_abs_diff"] == 0.0
            assert c["site_served_path"] == "reference" and errors == [0.0] * 4
        else:
            assert c["served_relative_error"] < 2e-2 and c["reference_relative_error"] < 2e-2
            assert c["site_served_path"] == "kernel" and 0 < max(errors) < 2e-2
    table = bdm.table(result)
    assert table in printed and table.count("\n") == 9 and "| 90 | 2 | tasq+loopvq |" in table
    monkeypatch.setattr(sys, "argv", ["bench_decode_model.py", "--table-from", str(tmp_path / "r.json")])
    bdm.main()
    assert capsys.readouterr().out.strip() == table


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
        _, got = bdm.decode_step(tiny_model, cache, ids)
        _, want = bdm.decode_step(tiny_model, bdm.decoded_cache(q, contents, serving), ids)
        swapped = {**contents, "codes": {n: p[::-1] for n, p in contents["codes"].items()}}
        _, other = bdm.decode_step(tiny_model, bdm.decoded_cache(q, swapped, serving), ids)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (other.float() - want.float()).abs().max() > 10 * (got.float() - want.float()).abs().max()
    page = contents["codes"]["value.b0.l0"][0]
    assert isinstance(page, Codes) and page.indices.shape == (2 * 8, 1, 32) and page.sigma is None


@pytest.mark.parametrize("method, channels", [("tasq+loopvq", False), ("tasq+loopvq-channels", True)])
def test_synthetic_quantizer_keys_follow_the_grouping(tiny_model, method, channels):
    """``tasq+loopvq-channels`` gives key layouts of the ``channels`` grouping (the test serving and the bundle
    writer use), each a permutation of the block's coordinates; plain ``tasq+loopvq`` gives a free one."""
    kv = tiny_model.kv_layout()
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


@pytest.mark.parametrize("served_cls", [QuantizedLoopKVCache, DoubledValues])
def test_site_check_follows_the_reference_and_measures_each_site(tiny_model, served_cls):
    """The per-site check's logits are a plain reference-cache decode's, bit for bit, whatever the served cache
    returns (teacher forcing); one error per KV site in site order: 0 when served is the reference path (both
    ``backend="torch"``), exactly 1 at every site when served doubles the values (not compounded over sites)."""
    serving = bdm.Serving(sink_tokens=8, recent_window=16, page_size=8)
    q = bdm.synthetic_quantizer(tiny_model.kv_layout(), "loopvq", codebook_size=256, group_size=16, steps_per_block=4,
                                device=DEVICE)
    contents = bdm.random_contents(q, serving, 75, batch=2, device=DEVICE, gen=torch.Generator(DEVICE).manual_seed(1))
    ids = torch.randint(0, 4096, (2, 1), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))

    def filled(cls):
        return bdm.fill_cache(cls(q, **dataclasses.asdict(serving), backend="torch"), **contents)

    site = bdm.SiteCheckCache(filled(served_cls), filled(QuantizedLoopKVCache))
    with torch.inference_mode():
        _, want = bdm.decode_step(tiny_model, filled(QuantizedLoopKVCache), ids)
        _, got = bdm.decode_step(tiny_model, site, ids)
    assert torch.equal(got, want)
    assert site.sites == [0, 1, 2, 3] and site.get_seq_length() == 76  # the reference cache's, one token on
    summary = site.summary()
    assert summary["site_served_path"] == "reference"
    expect = 0.0 if served_cls is QuantizedLoopKVCache else 1.0
    assert summary["site_relative_errors"] == pytest.approx([expect] * 4, abs=1e-6)
    assert summary["site_relative_error_max"] == summary["site_relative_error_median"] == pytest.approx(expect)


def test_site_check_through_the_triton_kernel(tmp_path):
    """--checks-only --check-kernel triton (Triton's interpreter on CPU, in a child process since
    TRITON_INTERPRET=1 must precede the import of triton; the GPU as it is): the served path is the kernel,
    each site's error small but not zero (fp16 step tables, bf16 output: about 4e-3 in the interpreter), the
    check's logits the reference path's; no timed case."""
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    if DEVICE.type == "cpu":
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "c.json"
    argv = [sys.executable, str(SCRIPT), "--scale-down", "16", "--check-context", "80", "--checks-only",
            "--check-kernel", "triton", "--device", str(DEVICE), "--out", str(out)]
    code = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert code.returncode == 0, code.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cases"] == [] and result["check_kernel"] == "triton"
    assert [c["method"] for c in result["checks"]] == ["loopvq", "tasq+loopvq", "tasq+loopvq-channels"]
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
    serving = dict(sink_tokens=4, recent_window=8, page_size=8)
    prefilled = QuantizedLoopKVCache(q, **serving)
    out = model(prompt, cache=prefilled, use_cache=True)
    positions = prefilled.positions[min(prefilled.positions)]
    state = dict(keys=dict(prefilled.keys), values=dict(prefilled.values), positions=positions,
                 codes={name: list(pages) for name, pages in prefilled.codes.items()})
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


def test_table_says_when_the_bf16_cache_does_not_fit():
    result = {"cases": [
        {"context": 65536, "batch": 32, "cache": "bf16", "status": "does not fit", "bf16_bytes": 1.65e12,
         "free_bytes": 1.45e11},
        {"context": 65536, "batch": 32, "cache": "loopvq", "status": "ok", "median_ms": 50.0, "mean_ms": 51.0,
         "tokens_per_s": 627.5, "peak_bytes": 1.1e11}]}
    table = bdm.table(result)
    assert "| 65536 | 32 | bf16 | does not fit, needs 1650.0 GB, 145.0 GB free |" in table
    assert "| 65536 | 32 | loopvq | 50.000 | 51.000 | 627.5 |  | 110.0 |" in table


def test_bf16_bytes_at_ouro_shapes():
    """96 sites x (K, V) x 16 heads x 128 x 2 bytes = 786,432 bytes per token: 32k x 8 is 206 GB."""
    kv = type("KV", (), {"num_sites": 96, "kv_heads": 16, "head_dim": 128})()
    assert bdm.bf16_bytes(kv, 32768, 8) == 786_432 * 32768 * 8 == 206_158_430_208


@pytest.mark.gpu
def test_served_path_is_the_kernel_on_the_gpu(tmp_path, monkeypatch):
    result = run_script(monkeypatch, tmp_path / "r.json", "--caches", "loopvq")
    assert result["cases"][0]["served_path"] == "kernel" and result["checks"][0]["served_path"] == "kernel"
