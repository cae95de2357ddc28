"""Building CUDA kernels at run time (kernels/cuda_build.py), on the CPU with stand-ins for NVRTC: a build's
constants, device and shared-memory limit, the record of builds, a failed build remembered and named (and the
decode dispatch's refusal after it), the torches it refuses, and the arrival counters the launches share."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from support.decode import make_codecs, make_inputs

from loopvq_calib.kernels import cuda_build, decode_cuda as dc
from loopvq_calib.kernels.backends import BackendUnavailable
from loopvq_calib.serving import decode_attention as da


def test_a_failed_build_is_remembered_and_named(builds, monkeypatch):
    """A failed NVRTC build raises BuildError naming the kernel and its constants and is kept (so later calls go
    to Triton without compiling again: the availability check gives it as the reason), and backend='cuda' then
    says so."""

    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: error: broken on purpose")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    with pytest.raises(cuda_build.BuildError, match="broken on purpose") as err:
        builds.kernel(dc.kernel_source(), dc.KERNEL, defines=(("D", 64), ("TASQ", 1)), shared=0, device=0)
    assert dc.KERNEL in str(err.value) and "'TASQ': 1" in str(err.value) and builds.failure is err.value
    assert builds.unavailable(torch.device("cuda", 0)) == f"an earlier build failed: {err.value}"
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    tables = da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16)
    with pytest.raises(BackendUnavailable, match="an earlier build failed: .*broken on purpose"):
        da.decode_attention(
            q, tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos), rope=da.RopeTable(64, 1e4), backend="cuda"
        )


def test_a_build_raises_the_shared_memory_limit_it_launches_with(builds, monkeypatch):
    """build_kernel compiles on the given device and sets the kernel's dynamic shared-memory limit to the launch's
    bytes; a torch whose kernels cannot set it is refused (BuildError); a second request for the same constants
    is served from the record."""
    made, entered = [], []

    class Kernel:
        def __init__(self):
            self.limit = None

        def set_shared_memory_config(self, shared):
            self.limit = shared

    def compile_kernel(source, name):
        made.append((source.splitlines()[:2], name))
        return Kernel()

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or contextlib.nullcontext())
    kernel = builds.kernel("KERNEL BODY", "k", defines=(("D", 64), ("U", 8)), shared=200_000, device=1)
    assert kernel.limit == 200_000 and entered == [1] and made == [(["#define D 64", "#define U 8"], "k")]
    assert builds.kernel("KERNEL BODY", "k", defines=(("D", 64), ("U", 8)), shared=200_000, device=1) is kernel
    assert len(made) == 1
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda source, name: object(), raising=False)
    with pytest.raises(cuda_build.BuildError, match="cannot raise their shared-memory limit"):
        cuda_build.build_kernel("KERNEL BODY", "k", shared=1024, device=0)
    monkeypatch.delattr(torch.cuda, "_compile_kernel", raising=False)
    with pytest.raises(cuda_build.BuildError, match="no torch.cuda._compile_kernel"):
        cuda_build.build_kernel("KERNEL BODY", "k", shared=1024, device=0)
    assert builds.unavailable(torch.device("cuda", 0)) == "this torch has no torch.cuda._compile_kernel (NVRTC)"


def test_split_counters_grow_and_keep_earlier_buffers(builds, monkeypatch):
    """One zeroed int32 buffer per device, at least 4096 counters, replaced by a larger one when a launch needs
    more (the earlier one kept alive for captured graphs); none can be made during a CUDA-graph capture."""
    cpu = torch.device("cpu")
    first = builds.counters(cpu, 16)
    assert first.numel() == 4096 and first.dtype == torch.int32 and not first.any()
    assert builds.counters(cpu, 4096) is first
    kept = weakref.ref(first)
    del first
    grown = builds.counters(cpu, 5000)
    gc.collect()
    assert grown.numel() == 8192 and builds.counters(cpu, 16) is grown and kept() is not None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(cuda_build.LaunchError, match="during CUDA-graph capture"):
        builds.counters(torch.device("cuda", 0), 16)
