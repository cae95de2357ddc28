"""The CUDA decode kernel's launch (kernels/decode_cuda.py): the calls it refuses (what the kernel reads, build
failures, devices, 32-bit offsets, shared memory), the RoPE rows it reads, hand-made plans checked and given ones
launched as is, the split counters and the launch's device and stream. CPU only (stand-ins for the CUDA runtime,
meta tensors); the launch plan is checked in test_decode_cuda_plan.py, the kernel itself in
test_decode_attention_cuda.py, its lane tables in test_decode_lanes.py."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
from support.decode import dispatch_case, head_major, make_codecs, make_inputs

from loopvq_calib.kernels import cuda_build, decode_cuda as dc, decode_cuda_plan as dcp, decode_lanes as dl
from loopvq_calib.kernels.backends import BackendUnavailable
from loopvq_calib.serving import decode_attention as da


def test_launch_checks_what_the_kernel_reads(builds, monkeypatch):
    """The CUDA path is taken only when the kernel can read every tensor as it assumes: one-byte key AND value
    indices stored head-major, fp16 TaSQ sigmas, unit inner strides, tables and buffers within shared memory
    (checked here with a stand-in CUDA query on the CPU), and never after a failed build."""
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 8)
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a, **k: None, raising=False)
    limit = SimpleNamespace(shared_memory_per_block_optin=228 * 1024, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: limit)
    cuda_q = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=fk.dtype, shape=q.shape)
    u8 = SimpleNamespace(
        key_indices=head_major(coded.key_indices.to(torch.uint8)),
        value_indices=head_major(coded.value_indices.to(torch.uint8)),
        key_sigma=None,
        count=coded.count,
    )

    def fits(coded, fk=fk, tokens=None) -> bool:
        settings = dc.CudaDecodeLaunch(warps=8, tokens_per_iteration=tokens)
        return isinstance(dcp.launch(lanes, cuda_q, fk, fp_values=fv, coded=coded, settings=settings), dc.LaunchPlan)

    assert fits(u8)
    assert not fits(SimpleNamespace(**{**vars(u8), "value_indices": u8.value_indices.int()}))
    assert not fits(SimpleNamespace(**{**vars(u8), "key_indices": coded.key_indices.to(torch.uint8)}))  # token-major
    assert not fits(SimpleNamespace(**{**vars(u8), "key_sigma": torch.ones(1, 8, 4)}))
    assert not fits(u8, fk.transpose(-1, -2))
    # 8 lanes per token: 4 groups x 8 tokens per warp step
    need = dcp.launch_shared(lanes, u8, 8, query_groups=1, tokens=8)
    assert need == 2 * 64 * 16 * 2 + 8 * 2 * 32 * 64 + 64 * 4 + 8 * 32 * 4 + 2 * 64 * 4  # tables, stages, query,
    # weights, channel maps
    limit.shared_memory_per_block_optin = need - 1
    assert not fits(u8, tokens=8)
    limit.shared_memory_per_block_optin = need
    assert fits(u8, tokens=8)
    builds.failure = cuda_build.BuildError("earlier")
    assert not fits(u8)


def test_large_batches_and_buffers_are_refused_only_where_32_bit_offsets_overflow():
    """At Ouro's shapes (16 KV heads, 32 one-byte codes per token) the kernel takes a code buffer of any total
    size (batch 64 x capacity 65536 holds 2**31 bytes: row offsets are 64-bit); it refuses only a batch stride
    (16 x capacity x 32 bytes) beyond 2**31 - 1, which also bounds a token's 32-bit offset in its stream."""
    kc, vc = make_codecs("loopvq", 16, 128, 256, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 16)
    fk = torch.empty(64, 76, 16, 128, dtype=torch.bfloat16, device="meta")
    q = torch.empty(64, 16, 128, dtype=torch.bfloat16, device="meta")
    for batch, capacity, refused in (
        (64, 65536, False),
        (32, 131072, False),
        (256, 2**20, False),
        (1, 2**22 - 1, False),
        (1, 2**22, True),
        (2, 2**23, True),
    ):
        idx = torch.empty(batch, 16, capacity, 32, dtype=torch.uint8, device="meta").transpose(1, 2)  # CodeBuffer's
        coded = SimpleNamespace(key_indices=idx, value_indices=idx, key_sigma=None, count=capacity - 100)
        reason = dcp.plan_launch(
            lanes,
            q[:batch],
            fk[:batch],
            fp_values=fk[:batch],
            coded=coded,
            settings=dc.CudaDecodeLaunch(),
            shared_limit=227 * 1024,
            sms=1,
        )
        assert isinstance(reason, str) == refused, (batch, capacity, reason)
        assert idx.stride(0) == 16 * capacity * 32 and (idx.stride(0) > dcp.INT32_MAX) == refused
        if refused:
            assert "stride beyond 2**31 - 1" in reason
    assert dcp.plan_launch(
        None, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=227 * 1024, sms=1
    ).startswith("the site has no lane tables")


def test_rope_rows_cover_every_anchor_read():
    """The kernel's anchor reads row (first position + t0 + group) for t0 any coded token index and group <
    32/lanes, and row 32/lanes for the recurrence: every read lies inside rope_rows(last position, lanes)."""
    for lanes in (8, 16):
        groups = 32 // lanes
        for first, n in ((0, 1), (5, 27), (1000, 24), (65533, 3)):
            last = first + n - 1
            reads = [first + t0 + grp for t0 in range(n) for grp in range(groups)] + [groups]
            rows = dcp.rope_rows(last, lanes)
            assert max(reads) < rows and rows >= 8, (lanes, first, n)
    first, n = 65000, 534  # 8 lanes, an empty window: the last anchor reads row first + n + 2 = 2**16
    assert dcp.rope_rows(first + n - 1, 8) > 2**16


def test_the_launch_runs_on_the_query_device_and_its_stream(builds, monkeypatch):
    """decode_attention_cuda launches inside torch.cuda.device(q.device) on that device's current stream, and
    turns a launch's RuntimeError into LaunchError (stand-ins for the CUDA runtime, CPU tensors)."""
    tables, coded, q, fk, fv, fpos, mask, _ = dispatch_case()
    lanes = dcp.site_lanes(tables, 1, 16)
    inputs = da.kernel_inputs(
        q, tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos, mask), rope=da.RopeTable(64, 1e4), rows=64
    )
    entered, launches = [], []

    @contextlib.contextmanager
    def device(d):
        entered.append(d)
        yield
        entered.append("left")

    def kernel(**kwargs):
        launches.append((list(entered), kwargs["stream"]))
        if len(launches) == 2:
            raise RuntimeError("CUDA error: invalid resource handle")

    props = SimpleNamespace(multi_processor_count=4, shared_memory_per_block_optin=227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: ("stream of", d))
    monkeypatch.setattr(cuda_build, "build_kernel", lambda source, name, *, shared, device: kernel)
    monkeypatch.setattr(
        dcp, "launch", lambda *args, **kwargs: dcp.plan_launch(*args, **kwargs, shared_limit=227 * 1024, sms=4)
    )  # CPU q: no CUDA check
    dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv)
    assert launches == [([q.device], ("stream of", q.device))] and entered[-1] == "left"
    with pytest.raises(dc.LaunchError, match="invalid resource handle"):
        dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv)


def test_a_given_plan_is_launched_as_is(builds, monkeypatch):
    """decode_attention_cuda with a plan (the dispatch's, from decode_cuda_plan.launch) does not work it out again:
    no device query, the plan's grid, block, shared memory and rows per pass."""
    tables, coded, q, fk, fv, fpos, mask, _ = dispatch_case()
    lanes = dcp.site_lanes(tables, 1, 16)
    inputs = da.kernel_inputs(
        q, tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos, mask), rope=da.RopeTable(64, 1e4), rows=64
    )
    launches = []

    def no_query(device):
        raise AssertionError("the plan was worked out again")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_query)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())

    def build(source, name, *, shared, device):
        constants = source[: source.index(dc.kernel_source())].splitlines()  # the #defines put before the source
        defines = dict(line.split()[1:] for line in constants)
        return lambda **kw: launches.append((defines, kw))

    monkeypatch.setattr(cuda_build, "build_kernel", build)
    plan = dc.LaunchPlan(warps=4, tokens=2, rows=2, splits=3, split_len=7, key_float32=False, shared=12345)
    out = dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv, plan=plan)
    ((defines, kw),) = launches
    assert kw["grid"] == (tables.value.shape[0], 3, 1) and kw["block"] == (128, 1, 1) and kw["shared_mem"] == 12345
    acc, ml, counters, written = kw["args"][18:22]
    assert defines["RPB"] == "2" and defines["U"] == "2" and acc.shape[2] == ml.shape[2] == 3
    assert written is out and out.shape == q.shape and out.dtype == q.dtype
    assert counters.dtype == torch.int32 and counters.numel() >= 2 * 2 and not counters.any()


def test_a_hand_made_plan_is_checked_and_no_plan_goes_through_launch(builds, monkeypatch):
    """A plan whose rows do not divide its warps, or a plan next to launch arguments it would silently override,
    raises ValueError before any build; without a plan, launch()'s refusals (a CPU query, an earlier failed
    build) raise LaunchError."""
    tables, coded, q, fk, fv, fpos, mask, _ = dispatch_case()
    lanes = dcp.site_lanes(tables, 1, 16)
    inputs = da.kernel_inputs(
        q, tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos, mask), rope=da.RopeTable(64, 1e4), rows=64
    )
    monkeypatch.setattr(cuda_build, "build_kernel", lambda *args, **kwargs: pytest.fail("built despite a bad plan"))
    plan = dc.LaunchPlan(warps=16, tokens=8, rows=3, splits=2, split_len=11, key_float32=False, shared=0)
    with pytest.raises(ValueError, match=r"rows per pass \(3\) must divide its warps \(16\)"):
        dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv, plan=plan)
    plan = dc.LaunchPlan(warps=16, tokens=8, rows=4, splits=2, split_len=11, key_float32=False, shared=0)
    with pytest.raises(ValueError, match="a launch plan and warps, rows_per_pass given"):
        dc.decode_attention_cuda(
            inputs,
            tables,
            lanes,
            coded=coded,
            fp_keys=fk,
            fp_values=fv,
            settings=dc.CudaDecodeLaunch(warps=8, rows_per_pass=2),
            plan=plan,
        )
    with pytest.raises(dc.LaunchError, match="refuses this call: device cpu is not CUDA"):
        dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv)
    builds.failure = cuda_build.BuildError("broken before")
    with pytest.raises(dc.LaunchError, match="an earlier build failed: broken before"):
        dc.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fk, fp_values=fv)


@pytest.mark.skipif(shutil.which("cpp") is None, reason="needs a C preprocessor")
def test_the_kernel_source_refuses_rows_that_do_not_divide_the_warps(tmp_path):
    """The kernel's source stops the build (#error) when RPB does not divide WARPS (the C preprocessor alone)."""
    source = tmp_path / "kernel.cu"
    source.write_text(dc.kernel_source())

    def preprocess(warps: int, rows: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["cpp", "-x", "c++", "-P", f"-DWARPS={warps}", f"-DRPB={rows}", str(source)], capture_output=True, text=True
        )

    for warps, rows in ((16, 3), (12, 8), (8, 0)):
        done = preprocess(warps, rows)
        assert done.returncode != 0 and "RPB (batch rows per pass) must divide WARPS" in done.stderr, (warps, rows)
    done = preprocess(12, 4)
    assert done.returncode == 0 and "loopvq_decode_split" in done.stdout, done.stderr


def test_cpu_tensors_never_take_the_cuda_kernel():
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16))
    assert (
        dcp.launch(lanes, q, fk, fp_values=fv, coded=coded, settings=dc.CudaDecodeLaunch(warps=8))
        == "device cpu is not CUDA"
    )
    tables = da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16)
    fp = da.FullPrecisionTokens(fk, fv, fpos)
    with pytest.raises(
        BackendUnavailable,
        match=r"decode attention: 'cuda' needs a CUDA device .*, not cpu \(device cpu "
        r"is not CUDA\)",
    ):
        da.decode_attention(q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4), backend="cuda")
    with pytest.raises(ValueError, match="decode attention: 'fast' is not one of auto, cuda, triton"):
        da.decode_attention(q, tables, coded, fp=fp, rope=da.RopeTable(64, 1e4), backend="fast")
