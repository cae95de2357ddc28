"""The CUDA decode kernel's launch plan (kernels/decode_cuda.py: plan_launch): rows per pass, the plan at Ouro
shapes, the key table's dtype, rows lowered until a GQA call fits, the tokens per step, zero settings refused. CPU
only: plans need shapes and strides (meta tensors); the launch's refusals and the launch itself are in
test_decode_cuda.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.decode import make_codecs

from loopvq_calib.kernels import decode_cuda as dc, decode_cuda_plan as dcp, decode_lanes as dl
from loopvq_calib.serving import decode_attention as da


def test_rows_per_pass_divide_the_warps_and_never_exceed_the_batch():
    for most, batch, warps, rows in (
        (8, 8, 16, 8),
        (8, 32, 16, 8),
        (8, 3, 16, 2),
        (8, 1, 16, 1),
        (4, 32, 12, 4),
        (8, 5, 12, 4),
        (8, 32, 12, 6),
        (1, 32, 16, 1),
        (16, 0, 16, 1),
    ):
        assert dcp.rows_per_pass(most, batch, warps) == rows, (most, batch, warps)
    with pytest.raises(ValueError, match="at least 1"):
        dcp.rows_per_pass(0, 8, 16)


def test_launch_plan_at_ouro_shapes():
    """16 tokens per lane group and step (32 per warp step); splits per KV head = multiprocessors / heads unless a
    split would give a warp less than one step's tokens (warps per row = warps / rows); shared memory holds a
    query per row of the pass."""
    kc, vc = make_codecs("loopvq", 16, 128, 256, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 16)
    fk = torch.empty(8, 76, 16, 128, dtype=torch.bfloat16, device="meta")
    for batch, n, rows, splits in (
        (8, 32768, 8, 8),
        (8, 100, 8, 2),
        (8, 200, 8, 4),
        (1, 100, 1, 1),
        (3, 100, 2, 1),
        (32, 500, 8, 8),
    ):
        idx = torch.empty(batch, 16, n, 32, dtype=torch.uint8, device="meta").transpose(1, 2)
        coded = SimpleNamespace(key_indices=idx, value_indices=idx, key_sigma=None, count=n)
        q = torch.empty(batch, 16, 128, dtype=torch.bfloat16, device="meta")
        plan = dcp.plan_launch(
            lanes,
            q,
            fk[:batch],
            fp_values=fk[:batch],
            coded=coded,
            settings=dc.CudaDecodeLaunch(),
            shared_limit=227 * 1024,
            sms=132,
        )
        assert (plan.warps, plan.tokens, plan.rows, plan.splits) == (16, 16, rows, splits), (batch, n, plan)
        assert plan.split_len == -(-n // splits) and not plan.key_float32
        # fp16 tables (2 x 64 KiB), 16 warps x 2 buffers x 32 tokens x 64 index bytes, queries, weights, channel maps
        assert plan.shared == 2 * 128 * 256 * 2 + 16 * 2 * 32 * 64 + rows * 128 * 4 + 16 * 32 * 4 + 2 * 128 * 4


def test_default_rows_give_way_to_a_float32_key_table():
    """TaSQ's keys (runs of 1) want the key table in float32 (128 KiB at Ouro's shapes): with 227 KiB of shared
    memory it fits at 8 tokens per step (not the default 16: 265,728 bytes at one row) with 2 query rows in
    shared memory, not 4 or 8, so the default tokens drop to 8 and the rows per pass to 2; rows asked for are
    kept and the table stays fp16, at 16 tokens (8 do not make it fit either)."""
    kc, vc = make_codecs("tasq+loopvq", 16, 128, 256, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 16)
    assert lanes.run_key == 1
    fk = torch.empty(8, 76, 16, 128, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(8, 16, 32768, 32, dtype=torch.uint8, device="meta").transpose(1, 2)
    coded = SimpleNamespace(
        key_indices=idx,
        value_indices=idx,
        count=32000,
        key_sigma=torch.empty(8, 32768, 4, dtype=torch.float16, device="meta"),
    )
    q = torch.empty(8, 16, 128, dtype=torch.bfloat16, device="meta")
    tables = 128 * 256 * 4 + 128 * 256 * 2
    assert (
        dcp.launch_shared(lanes, coded, 16, query_groups=1, tokens=16, key_dtype=torch.float32)
        == tables + 16 * 2 * 32 * 64 + 512 + 2048 + 1024
    )
    plan = dcp.plan_launch(
        lanes, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=227 * 1024, sms=132
    )
    assert (plan.tokens, plan.rows, plan.key_float32) == (8, 2, True)
    assert plan.shared == tables + 16 * 2 * 16 * 64 + 2 * 128 * 4 + 16 * 16 * 4 + 2 * 128 * 4 <= 227 * 1024
    plan = dcp.plan_launch(
        lanes,
        q,
        fk,
        fp_values=fk,
        coded=coded,
        settings=dc.CudaDecodeLaunch(rows_per_pass=8),
        shared_limit=227 * 1024,
        sms=132,
    )
    assert (plan.tokens, plan.rows, plan.key_float32) == (16, 8, False)
    plan = dcp.plan_launch(
        lanes,
        q,
        fk,
        fp_values=fk,
        coded=coded,
        settings=dc.CudaDecodeLaunch(tokens_per_iteration=16),
        shared_limit=227 * 1024,
        sms=132,
    )
    assert (plan.tokens, plan.rows, plan.key_float32) == (16, 8, False)  # 16 tokens asked for: no fp32 table


def ouro_like_call(method: str, kv_heads: int, q_heads: int, batch: int, n: int = 32000):
    """Lane tables (16 lanes, fp16) and meta tensors of a call at Ouro's D 128, K 256, 32 index bytes per token."""
    kc, vc = make_codecs(method, kv_heads, 128, 256, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 16)
    fk = torch.empty(batch, 76, kv_heads, 128, dtype=torch.bfloat16, device="meta")
    idx = torch.empty(batch, kv_heads, n + 768, 32, dtype=torch.uint8, device="meta").transpose(1, 2)
    sigma = torch.empty(batch, n + 768, 4, dtype=torch.float16, device="meta") if method.startswith("tasq") else None
    coded = SimpleNamespace(key_indices=idx, value_indices=idx, key_sigma=sigma, count=n)
    return lanes, torch.empty(batch, q_heads, 128, dtype=torch.bfloat16, device="meta"), fk, coded


def test_default_rows_are_lowered_until_a_gqa_call_fits():
    """16 query heads per KV head (8 warps x 4 tokens): the merge area (8 x 16 x 130 floats) and 16 queries per
    row leave room for 2 rows of a pass with fp16 tables, not the default 8 (268,288 bytes) or 4: the default
    rows drop to 2 rather than the call being refused."""
    lanes, q, fk, coded = ouro_like_call("loopvq", 4, 64, 8)
    limit = 227 * 1024

    def need(rows):  # fp16 tables, merge area (larger than the stages), queries, weights, channel maps
        return 2 * 128 * 256 * 2 + 8 * 16 * 130 * 4 + rows * 16 * 128 * 4 + 8 * 16 * 8 * 4 + 2 * 128 * 4

    assert need(8) == 268288 and need(4) > limit >= need(2)
    plan = dcp.plan_launch(
        lanes, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=limit, sms=132
    )
    assert (plan.warps, plan.tokens, plan.rows, plan.key_float32, plan.shared) == (8, 4, 2, False, need(2))
    assert plan.splits == 132 // 4
    assert isinstance(
        dcp.plan_launch(
            lanes,
            q,
            fk,
            fp_values=fk,
            coded=coded,
            settings=dc.CudaDecodeLaunch(rows_per_pass=4),
            shared_limit=limit,
            sms=132,
        ),
        str,
    )


def test_rows_are_kept_when_a_float32_key_table_fits_at_no_rows():
    """TaSQ's keys want a float32 table, but with 8 query heads per KV head it needs 237,056 bytes even at one
    row per pass: the table stays fp16 and the default 8 rows are kept (they fit)."""
    lanes, q, fk, coded = ouro_like_call("tasq+loopvq", 8, 64, 8)
    assert lanes.run_key == 1
    limit = 227 * 1024

    def need(key_bytes, rows):  # tables, merge area, queries, weights, channel maps
        return 128 * 256 * (key_bytes + 2) + 8 * 8 * 130 * 4 + rows * 8 * 128 * 4 + 8 * 8 * 8 * 4 + 2 * 128 * 4

    assert need(4, 1) == 237056 > limit >= need(2, 8)
    plan = dcp.plan_launch(
        lanes, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=limit, sms=132
    )
    assert (plan.rows, plan.key_float32, plan.shared) == (8, False, need(2, 8))


def test_a_float32_key_table_asked_for_is_refused_where_it_does_not_fit():
    """At Ouro's shapes a float32 key table (128 KiB) fits at 8 tokens per step with 2 rows' queries exactly
    (232,448 bytes), not with 8 rows (235,520) nor at the default 16 tokens: key_float32=True at 8 rows is
    refused naming both byte counts (at 16 tokens), never served with fp16 keys."""
    lanes, q, fk, coded = ouro_like_call("loopvq", 16, 16, 8)
    limit = 227 * 1024
    need = 128 * 256 * (4 + 2) + 16 * 2 * 16 * 64 + 2 * 128 * 4 + 16 * 16 * 4 + 2 * 128 * 4  # at 2 rows
    plan = dcp.plan_launch(
        lanes,
        q,
        fk,
        fp_values=fk,
        coded=coded,
        settings=dc.CudaDecodeLaunch(rows_per_pass=2, key_float32=True),
        shared_limit=limit,
        sms=132,
    )
    assert (plan.tokens, plan.rows, plan.key_float32, plan.shared) == (8, 2, True, need) and need == limit
    reason = dcp.plan_launch(
        lanes,
        q,
        fk,
        fp_values=fk,
        coded=coded,
        settings=dc.CudaDecodeLaunch(rows_per_pass=8, key_float32=True),
        shared_limit=limit,
        sms=132,
    )
    at16 = need + 6 * 128 * 4 + 16 * 2 * 16 * 64 + 16 * 16 * 4  # 8 rows, 16 tokens: more stages and weights
    assert reason == f"a float32 key table needs {at16} bytes of shared memory, {limit} available"
    plan = dcp.plan_launch(
        lanes,
        q,
        fk,
        fp_values=fk,
        coded=coded,
        settings=dc.CudaDecodeLaunch(key_float32=True),
        shared_limit=limit,
        sms=132,
    )
    assert (plan.tokens, plan.rows, plan.key_float32) == (8, 2, True)  # default tokens and rows give way


def test_zero_rows_warps_or_tokens_are_refused_not_taken_for_the_default():
    lanes, q, fk, coded = ouro_like_call("loopvq", 16, 16, 8)
    with pytest.raises(ValueError, match="rows per pass must be at least 1, got 0"):
        dcp.plan_launch(
            lanes,
            q,
            fk,
            fp_values=fk,
            coded=coded,
            settings=dc.CudaDecodeLaunch(rows_per_pass=0),
            shared_limit=227 * 1024,
            sms=132,
        )
    for warps, tokens in ((0, None), (None, 0)):
        with pytest.raises(ValueError, match="tokens_per_iteration must be"):
            dcp.plan_launch(
                lanes,
                q,
                fk,
                fp_values=fk,
                coded=coded,
                settings=dc.CudaDecodeLaunch(warps=warps, tokens_per_iteration=tokens),
                shared_limit=227 * 1024,
                sms=132,
            )


def test_default_tokens_per_step_follow_the_lanes():
    """16 tokens per lane group and step by default (one query head per KV head), at most the lanes per token (8
    at 8 lanes); GQA keeps 4; more tokens than lanes are refused."""
    lanes, q, fk, coded = ouro_like_call("loopvq", 16, 16, 8)
    plan = dcp.plan_launch(
        lanes, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=227 * 1024, sms=132
    )
    assert (plan.warps, plan.tokens, plan.rows) == (16, 16, 8)
    kc, vc = make_codecs("loopvq", 16, 128, 256, 16, 4)
    lanes8 = dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float16), 8)
    assert (
        dcp.plan_launch(
            lanes8, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=227 * 1024, sms=132
        ).tokens
        == 8
    )
    with pytest.raises(ValueError, match=r"up to the lanes per token \(8\).*got 16"):
        dcp.plan_launch(
            lanes8,
            q,
            fk,
            fp_values=fk,
            coded=coded,
            settings=dc.CudaDecodeLaunch(tokens_per_iteration=16),
            shared_limit=227 * 1024,
            sms=132,
        )
    lanes, q, fk, coded = ouro_like_call("loopvq", 4, 16, 8)
    assert (
        dcp.plan_launch(
            lanes, q, fk, fp_values=fk, coded=coded, settings=dc.CudaDecodeLaunch(), shared_limit=227 * 1024, sms=132
        ).tokens
        == 4
    )
