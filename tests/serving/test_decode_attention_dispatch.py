"""The dispatch between the CUDA and the Triton decode kernel (serving/decode_attention.py, kernels/backends.py):
under ``auto`` a failed launch, a refused call or a failed build falls back to the Triton kernel with one warning,
and both serving call sites take the kernels in the listed order. The CUDA kernel is stood in for on CPU tensors;
the Triton kernel runs on a CUDA GPU or in Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_ouro, needs_triton_kernels as needs_kernels
from support.decode import dispatch_case
from support.quantizers import sampled_quantizer

from loopvq_calib.kernels import backends, cuda_build, decode_cuda, decode_cuda_plan
from loopvq_calib.kernels.backends import Backend
from loopvq_calib.serving import cache as cache_module, decode_attention as da


class CpuAsCuda(cuda_build.CudaBuilds):
    """NVRTC builds whose device check takes CPU tensors for CUDA ones (the rest of the check as it is)."""

    def unavailable(self, device: torch.device) -> str:
        return super().unavailable(torch.device("cuda", 0))


@pytest.fixture
def stand_in_cuda(monkeypatch, caplog):
    """``auto`` considers the CUDA kernel for CPU tensors and NVRTC builds look available (the dispatch under
    test, Triton's interpreter behind); the dispatcher starts afresh and its warnings reach caplog."""
    monkeypatch.setattr(da, "_on_cuda", lambda q: True)
    monkeypatch.setattr(cuda_build, "BUILDS", CpuAsCuda())
    monkeypatch.setattr(logging.getLogger("loopvq_calib"), "propagate", True)
    backends.DISPATCH.clear()
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        yield caplog
    backends.DISPATCH.clear()


@needs_kernels
def test_a_failed_launch_falls_back_to_triton_with_a_warning(stand_in_cuda, monkeypatch):
    """Under ``auto`` a launch failure (LaunchError) warns once and the Triton kernel serves the call (the site
    does not try the CUDA kernel again); ``backend="cuda"`` raises it. The launch was given a RoPE table of
    rope_rows rows."""
    tables, coded, q, fk, fv, fpos, mask, ref = dispatch_case()
    fp = da.FullPrecisionTokens(fk, fv, fpos, mask)
    rows = []

    def failing_launch(inputs, tables, lanes, *args, **kwargs):
        rows.append(inputs.cos.shape[0])
        raise decode_cuda.LaunchError("cuLaunchKernel failed on purpose")

    plan = decode_cuda_plan.LaunchPlan(16, 8, 1, 2, 11, False, 0)
    monkeypatch.setattr(decode_cuda_plan, "launch", lambda lanes, *args, **kwargs: plan if lanes else "no lane tables")
    monkeypatch.setattr(decode_cuda, "decode_attention_cuda", failing_launch)
    out = da.decode_attention(
        q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4), triton=da.TritonDecodeLaunch(num_splits=2)
    )
    assert (
        "decode attention auto: using the Triton decode kernel on cpu, not the CUDA decode kernel: cuLaunchKernel "
        "failed on purpose" in stand_in_cuda.text
    )
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert tables.lanes[16] is None and len(rows) == 1
    assert rows[0] >= decode_cuda_plan.rope_rows(int(coded.first_position.max()) + coded.count, 16)
    tables.lanes.clear()
    with pytest.raises(decode_cuda.LaunchError, match="on purpose"):
        da.decode_attention(q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4), backend="cuda")
    assert len(rows) == 2


@needs_kernels
def test_a_refused_call_warns_once_per_reason(stand_in_cuda, monkeypatch):
    """A call ``auto`` would give the CUDA kernel but the kernel refuses goes to Triton with one warning per
    reason and process (not per call)."""
    tables, coded, q, fk, fv, fpos, mask, ref = dispatch_case()
    fp = da.FullPrecisionTokens(fk, fv, fpos, mask)
    monkeypatch.setattr(decode_cuda_plan, "launch", lambda *args, **kwargs: "a stride beyond 2**31 - 1 elements")
    out = da.decode_attention(q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4))
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    da.decode_attention(q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4))
    assert stand_in_cuda.text.count("not the CUDA decode kernel: a stride beyond 2**31 - 1 elements") == 1


@needs_kernels
def test_a_failed_build_falls_back_to_triton_and_later_calls_do_not_build(stand_in_cuda, monkeypatch):
    """A failed NVRTC build under ``auto``: one warning naming the kernel's constants and the error, the Triton
    kernel's output (equal to the reference), and no second build at the next call: the failure is remembered
    (the availability check gives it as the reason)."""
    tables, coded, q, fk, fv, fpos, mask, ref = dispatch_case()
    fp = da.FullPrecisionTokens(fk, fv, fpos, mask)
    builds = []

    def broken(source, name, *, shared, device):
        builds.append(name)
        raise cuda_build.BuildError("nvrtc: error: broken on purpose")

    monkeypatch.setattr(cuda_build, "build_kernel", broken)
    monkeypatch.setattr(
        decode_cuda_plan, "launch", lambda *args, **kwargs: decode_cuda_plan.LaunchPlan(16, 8, 1, 2, 11, False, 0)
    )
    for _ in range(2):
        out = da.decode_attention(
            q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4), triton=da.TritonDecodeLaunch(num_splits=2)
        )
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert builds == [decode_cuda.KERNEL]
    text = stand_in_cuda.text
    assert text.count(f"not the CUDA decode kernel: {decode_cuda.KERNEL} with {{'D': 64,") == 1
    assert "broken on purpose" in text
    assert text.count("not the CUDA decode kernel: an earlier build failed: ") == 1


def test_decode_attention_and_the_cache_take_the_kernels_in_the_listed_order(monkeypatch):
    """Both serving call sites read kernels/backends.py's DECODE_CANDIDATES: with the list reversed, decode
    attention's dispatch gets its candidates (each with its call filled in) and the cache's check of an explicit
    backend gets the kernels in that order, and the cache's ``auto`` asks whether the last one, the fallback,
    runs on the query's CUDA device."""
    tables, coded, q, fk, fv, fpos, mask, _ = dispatch_case()
    quantizer = sampled_quantizer(
        make_tiny_ouro(), torch.randint(0, 4096, (1, 16)), "loopvq", codebook_size=16, group_size=8
    )
    query = SimpleNamespace(shape=(1, 1, 4, 16), device=torch.device("cuda"))  # only its shape and device are read
    listed = tuple(reversed(backends.DECODE_CANDIDATES))
    monkeypatch.setattr(backends, "DECODE_CANDIDATES", listed)
    given: dict[str, list] = {}
    monkeypatch.setattr(
        backends.DISPATCH, "run", lambda requested, candidates, **kw: given.setdefault("run", candidates)
    )
    monkeypatch.setattr(
        backends.DISPATCH, "choose", lambda requested, candidates, **kw: given.setdefault("choose", candidates)
    )
    asked = []
    monkeypatch.setattr(cache_module, "available", lambda backend, device: asked.append(backend) or True)
    da.decode_attention(q, tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos, mask), rope=da.RopeTable(64, 1e4))
    assert cache_module.QuantizedLoopKVCache(quantizer, 4, 8, backend="cuda").decode_backend(query) is Backend.CUDA
    assert cache_module.QuantizedLoopKVCache(quantizer, 4, 8).decode_backend(query) is Backend.AUTO
    order = [(c.backend, c.label) for c in listed]
    assert [(c.backend, c.label) for c in given["run"]] == order == [(c.backend, c.label) for c in given["choose"]]
    assert all(c.run is not None for c in given["run"]) and asked == [Backend.CUDA]
