"""Decode attention over coded pages: the Triton kernels against the float64 PyTorch reference, for every
method's layouts, both RoPE styles, GQA and MHA, page boundaries and full-precision regions of several sizes.

The kernels run on a CUDA GPU, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, about a
second per case). Tolerance: relative L2 error of the output 1e-5 with float32 tables and inputs (the only
differences are float32 rounding and the angle-addition RoPE), 1e-2 with float16 tables and bf16 inputs
and output (codeword values to fp16, the output to bf16: about 4e-3 measured). The step tables are checked in
test_decode_attention_tables.py, the dispatch between the CUDA and the Triton kernel in
test_decode_attention_dispatch.py."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE, needs_triton_kernels as needs_kernels
from safetensors.torch import load_file
from support.decode import check, make_codecs, make_inputs
from support.golden import GOLDEN, GOLDEN_ATTENTION, attention_golden_case

from loopvq_calib.codes.packing import read_indices
from loopvq_calib.kernels import decode_triton
from loopvq_calib.serving import decode_attention as da


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


def test_plan_splits_covers_every_token_in_whole_tiles():
    for n in (0, 1, 15, 16, 1000, 32768):
        for heads in (1, 16, 256):
            splits, per = decode_triton.plan_splits(n, heads, 16, programs=132)
            assert per % 16 == 0 and splits >= 1
            assert (splits - 1) * per < max(n, 1) <= splits * per or n == 0
            assert splits * heads <= max(132, heads)
    # 16 heads x 8 splits on 132 multiprocessors
    assert decode_triton.plan_splits(32768, 16, 16, programs=132) == (8, 4096)


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
