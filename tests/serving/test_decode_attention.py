"""Decode attention over coded pages: the Triton kernels against the float64 PyTorch reference, for every
method's layouts, both RoPE styles, GQA and MHA, page boundaries and full-precision regions of several sizes.

The kernels run on a CUDA GPU, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, about a
second per case). Tolerance: relative L2 error of the output 1e-5 with float32 tables and inputs (the only
differences are float32 rounding and the angle-addition RoPE), 1e-2 with float16 tables and bf16 inputs
and output (codeword values to fp16, the output to bf16: about 4e-3 measured)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE, make_tiny_ouro, needs_triton_kernels as needs_kernels
from safetensors.torch import load_file
from support.decode import check, dispatch_case, gen, make_codecs, make_inputs
from support.golden import GOLDEN, GOLDEN_ATTENTION, attention_golden_case
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.codec import Codes
from loopvq_calib.codes.packing import read_indices
from loopvq_calib.kernels import backends, cuda_build, decode_cuda, decode_cuda_plan, decode_triton
from loopvq_calib.kernels.backends import Backend
from loopvq_calib.serving import cache as cache_module, decode_attention as da


@needs_kernels
@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_every_method_and_rope_style_matches_the_reference(method, style):
    """MHA, coded tokens over several splits and a partial last tile, a masked left padding."""
    check(method, style, heads=2, q_heads=2, n=37, s_fp=6, splits=3, pad=2)


@needs_kernels
@pytest.mark.parametrize(
    "n, s_fp, block_n, splits",
    [
        (0, 1, 8, None),  # nothing coded yet: the new token alone
        (1, 3, 8, None),
        (8, 9, 8, 1),
        (15, 4, 8, 2),
        (16, 20, 8, 2),
        (17, 2, 16, 4),
        (40, 12, 16, 8),
    ],
)
def test_page_and_tile_boundaries_and_region_sizes(n, s_fp, block_n, splits):
    check("loopvq", "half", heads=2, q_heads=2, n=n, s_fp=s_fp, block_n=block_n, splits=splits, seed=n)


@needs_kernels
@pytest.mark.parametrize("method, style", [("loopvq", "half"), ("tasq+loopvq", "interleaved")])
def test_gqa_query_groups_share_their_kv_head(method, style):
    check(method, style, heads=2, q_heads=6, n=21, s_fp=5, splits=2, seed=3)


@needs_kernels
@pytest.mark.parametrize("per_program", [2, 3])
def test_programs_that_loop_over_several_sequences(per_program):
    check(
        "tasq+loopvq",
        "half",
        heads=2,
        q_heads=4,
        n=13,
        s_fp=5,
        splits=2,
        batch=5,
        per_program=per_program,
        pad=1,
        seed=13,
        hints=per_program == 2,
    )


@needs_kernels
@pytest.mark.parametrize("sharing", ["heads", "groups", "all"])
def test_shared_codebooks(sharing):
    check("loopvq", "half", heads=3, q_heads=3, n=12, s_fp=4, sharing=sharing, seed=5)


@needs_kernels
def test_head_dim_that_is_no_power_of_two():
    """Huginn's head dim is 96: channels are padded to 128 inside the kernel."""
    check("tasq+loopvq", "interleaved", heads=2, q_heads=2, n=19, s_fp=5, d=24, g=4, splits=2, seed=9)


@needs_kernels
def test_int32_indices_for_large_codebooks():
    check("cq", "interleaved", heads=1, q_heads=2, n=10, s_fp=3, k=300, seed=7)


@needs_kernels
def test_float16_tables_and_bf16_inputs_within_bf16_tolerance():
    check(
        "tasq+loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=30,
        s_fp=7,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        seed=11,
    )


def test_step_tables_reproduce_the_codec_decode():
    """Channel table x indices = BlockCodec.decode at every step (TaSQ weight divided in, sigma apart)."""
    kc, _ = make_codecs("tasq+loopvq", 2, 16, 16, 8, 4)
    idx = torch.randint(0, 16, (5, 2, kc.layout.num_groups), generator=gen(1)).to(torch.uint8)
    sigma = torch.ones(5, 4).half()
    full = kc.decode(Codes(idx, sigma))  # [5, T, H, D]
    for step in range(4):
        table, code = da.channel_table(kc, step)
        picked = idx.long().gather(2, code[None].expand(5, -1, -1))  # [5, H, D]
        got = table[torch.arange(2)[None, :, None], picked, torch.arange(16)]
        torch.testing.assert_close(got, full[:, step], rtol=1e-6, atol=1e-6)


@needs_kernels
def test_float16_tables_with_large_biased_keys():
    """Keys with near-constant channels around 10 and queries of scale 5 (q . k of a few hundred), fp16 tables
    and bf16 inputs: the tables' rounding stays within the fp16 tolerance (the Triton kernel reads the tables
    in fp16 but sums in fp32; the CUDA kernel's packed-half sums are checked on the GPU)."""
    check(
        "loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=37,
        s_fp=6,
        splits=3,
        pad=2,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        seed=12,
        key_bias=10.0,
        q_scale=5.0,
    )


@needs_kernels
def test_float16_keys_with_float32_values():
    """Values of a few thousand: the value table switches to fp32 while the keys stay fp16 (both dtypes in one
    call)."""
    check(
        "loopvq",
        "interleaved",
        heads=2,
        q_heads=4,
        n=29,
        s_fp=5,
        splits=2,
        pad=1,
        table_dtype=torch.float16,
        dtype=torch.float32,
        tol=1e-2,
        seed=14,
        value_scale=2000.0,
    )


def test_tables_switch_to_float32_where_packed_half_sums_could_overflow():
    """A value table is float16 while VALUE_TERMS of its values sum within float16's range, a key table while
    KEY_TERMS products with a query channel of QUERY_BOUND do; beyond, that table (only) is float32."""
    fmax = torch.finfo(torch.float16).max
    value_limit, key_limit = fmax / da.VALUE_TERMS, fmax / (da.KEY_TERMS * da.QUERY_BOUND)
    for key_max, value_max, key_dtype, value_dtype in (
        (3.0, 3.0, torch.float16, torch.float16),
        (0.99 * key_limit, 0.99 * value_limit, torch.float16, torch.float16),
        (3.0, 1.01 * value_limit, torch.float16, torch.float32),
        (1.01 * key_limit, 3.0, torch.float32, torch.float16),
        (1.01 * key_limit, 1.01 * value_limit, torch.float32, torch.float32),
    ):
        kc, vc = make_codecs("loopvq", 2, 32, 16, 8, 4)
        for codec, largest in ((kc, key_max), (vc, value_max)):
            codec.codebook.data *= largest / da.channel_table(codec, 1)[0].abs().max()  # the step's largest
        tables = da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float16)
        assert (tables.key_a.dtype, tables.key_b.dtype, tables.value.dtype) == (key_dtype, key_dtype, value_dtype)
        assert torch.allclose(
            tables.value.float(),
            da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float32).value,
            rtol=1e-3,
        )
        assert (
            da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float32).key_a.dtype == torch.float32
        )
    assert value_limit > 4000 and 200 < key_limit < 300  # 65504 / 16 and 65504 / 256


def test_step_tables_refuse_a_layout_that_misses_channels():
    kc, vc = make_codecs("loopvq", 1, 16, 16, 8, 4)
    kc.layout.groups = kc.layout.groups.clone()
    kc.layout.groups[0, 0, 0] = kc.layout.groups[0, 0, 1]  # one coordinate twice, another never
    with pytest.raises(ValueError, match="does not cover the 16 channels exactly once"):
        da.step_tables(kc, vc, 0, rope_style="half", device="cpu")


def test_plan_splits_covers_every_token_in_whole_tiles():
    for n in (0, 1, 15, 16, 1000, 32768):
        for heads in (1, 16, 256):
            splits, per = decode_triton.plan_splits(n, heads, 16, programs=132)
            assert per % 16 == 0 and splits >= 1
            assert (splits - 1) * per < max(n, 1) <= splits * per or n == 0
            assert splits * heads <= max(132, heads)
    assert decode_triton.plan_splits(32768, 16, 16, programs=132) == (
        8,
        4096,
    )  # 16 heads x 8 splits on 132 multiprocessors


@needs_kernels
def test_bad_shapes_are_refused():
    kc, vc = make_codecs("tasq", 2, 16, 16, 8, 1)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 3, 4, 2, 0)
    tables = da.step_tables(kc, vc, 0, rope_style="half", device=DEVICE)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        da.decode_attention(
            q.to(DEVICE), tables, coded, fp=da.FullPrecisionTokens(fk, fv, fpos), rope=da.RopeTable(16, 1e4)
        )
    coded.key_sigma = None
    with pytest.raises(ValueError, match="key_sigma"):
        da.decode_attention(
            q[:, :2].to(DEVICE),
            tables,
            coded,
            fp=da.FullPrecisionTokens(fk.to(DEVICE), fv.to(DEVICE), fpos.to(DEVICE)),
            rope=da.RopeTable(16, 1e4),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["loopvq", "tasq+loopvq"])
def test_ouro_shapes_on_the_gpu(method):
    """Ouro-1.4B's site shapes (16 KV heads, D 128, K 256, G 16, T_c 4), bf16 inputs, fp16 tables, default splits."""
    check(
        method,
        "half",
        heads=16,
        q_heads=16,
        n=3000,
        s_fp=72,
        steps=4,
        d=128,
        k=256,
        g=16,
        block_n=16,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
    )


# -- the dispatch between the CUDA and the Triton kernel -------------------------------------------------


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


# -- attention-level golden vectors (tests/golden_attention) --------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("case", ["ouro_loopvq", "huginn_tasq_loopvq", "ouro_tasq_loopvq_channels"])
def test_kernel_reproduces_the_attention_golden_vectors(case):
    """From the packed codes (read back to uint8), as a backend reading format 1.1 files would."""
    _, block, bundle, (kc, vc) = attention_golden_case(case)
    gold = load_file(str(GOLDEN_ATTENTION / "attention.safetensors"))
    expected = load_file(str(GOLDEN / "expected.safetensors"))
    sigma = expected.get(f"{case}/key.{block}.sigma")
    idx = {
        kind: read_indices(
            gold,
            f"{case}/{kind}",
            bundle.meta["codebook_size"],
            count=expected[f"{case}/{kind}.{block}.indices"].shape[-1],
        ).to(torch.uint8)
        for kind in ("key", "value")
    }
    coded = da.CodedTokens(
        idx["key"][None].to(DEVICE),
        idx["value"][None].to(DEVICE),
        None if sigma is None else sigma[None].to(DEVICE),
        16,
        gold[f"{case}/coded_positions"][:1],
    )
    rope = da.RopeTable(kc.layout.head_dim, bundle.meta["rope"]["theta"])
    for m in range(kc.layout.steps):
        tables = da.step_tables(kc, vc, m, rope_style=bundle.meta["rope"]["style"], device=DEVICE, dtype=torch.float32)
        fp = da.FullPrecisionTokens(
            gold[f"{case}/fp_keys"][m][None].to(DEVICE),
            gold[f"{case}/fp_values"][m][None].to(DEVICE),
            gold[f"{case}/fp_positions"][None].to(DEVICE),
        )
        out = da.decode_attention(
            gold[f"{case}/query"][m][None].to(DEVICE),
            tables,
            coded,
            fp=fp,
            rope=rope,
            triton=da.TritonDecodeLaunch(block_n=8, num_splits=2),
            cuda=da.CudaDecodeLaunch(num_splits=2),
        )
        ref = gold[f"{case}/output"][m]
        assert ((out[0].cpu() - ref).norm() / ref.norm()) < 1e-5
