"""The shared-memory CUDA decode kernel (loopvq_calib/decode_cuda.py + decode_attention.cu).

On CPU: the lane tables the kernel reads are checked by an independent float64 emulation of the kernel's
reads (each lane's runs at the kernel's shared-memory offsets, its registers, RoPE pairs and value channels)
against the reference attention, for every method, both RoPE styles and GQA; the run lengths of known
layouts (the launch plan and the calls it refuses: test_decode_cuda.py). On a GPU (``gpu``): the kernel itself against the reference
(tolerances as in test_decode_attention.py: 1e-5 with float32 tables and inputs, 1e-2 with float16 tables and
bf16 inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from loopvq_calib import decode_attention as da
from loopvq_calib import decode_cuda as dc
from loopvq_calib.models.common import pair_channels, rope_angles
import test_decode_attention
from test_decode_attention import check, make_codecs, make_inputs

CUDA = torch.cuda.is_available()


def lane_reads(idx: torch.Tensor, table: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """What every lane reads per token, at the kernel's offsets: idx [B, n, H, codes], table [H, runs, K, L,
    run] read flat at (r * K * L + lane) * run + index * L * run + i, column [H, L, runs] -> [B, n, H, L,
    runs * run] float64 in run-major order."""
    heads, runs, k, lanes, run = table.shape
    b, n = idx.shape[:2]
    flat = table.double().reshape(heads, -1)
    ix = idx.long().gather(3, column.long().reshape(1, 1, heads, -1).expand(b, n, -1, -1)).view(b, n, heads, lanes, runs)
    r, lane, i = torch.arange(runs), torch.arange(lanes), torch.arange(run)
    offset = ((r[None, :, None] * k * lanes + lane[:, None, None]) * run + i) + ix[..., None] * lanes * run
    return flat[torch.arange(heads)[None, None, :, None], offset.reshape(b, n, heads, -1)].view(b, n, heads, lanes, -1)


def emulate(q: torch.Tensor, tables: da.StepTables, coded: da.CodedTokens, fk, fv, fpos, mask, theta: float,
            lane_count: int):
    """The kernel's reads and arithmetic in lane order, float64: keys gathered into each lane's registers
    (first channels of its pairs, then second ones), the query rotated per pair on the query side, values
    accumulated per lane and scattered to their channels."""
    lanes = dc.lane_tables(tables, lane_count)
    bsz, hq, d = q.shape
    L = lane_count
    heads, n, per, pairs = lanes.key.shape[0], coded.count, d // L, d // (2 * L)
    qg = hq // heads
    regs = torch.tensor(dc.key_registers(per, lanes.run_key, lanes.key_mixed))
    kreg = torch.empty(bsz, n, heads, L, per, dtype=torch.float64)
    kreg[..., regs] = lane_reads(coded.key_indices[:, :n], lanes.key, lanes.key_column)
    if tables.tasq and n:
        kreg = kreg * coded.key_sigma[:, :n, tables.step].double()[:, :, None, None, None]
    vreg = lane_reads(coded.value_indices[:, :n], lanes.value, lanes.value_column)  # [B, n, H, 16, per]
    kch, vch = lanes.key_channel.long(), lanes.value_channel.long()  # [H, D]
    kfp = fk.double().gather(3, kch[None, None].expand(bsz, fk.shape[1], -1, -1)).view(bsz, -1, heads, L, per)
    vfp = fv.double().gather(3, vch[None, None].expand(bsz, fv.shape[1], -1, -1)).view(bsz, -1, heads, L, per)
    keys, values = torch.cat([kreg, kfp], 1), torch.cat([vreg, vfp], 1)  # [B, S, H, L, per]
    qreg = q.double().view(bsz, heads, qg, d).gather(3, kch[None, :, None, :].expand(bsz, -1, qg, -1))
    qa, qb = qreg.view(bsz, heads, qg, L, 2, pairs).unbind(4)  # [B, H, qg, L, pairs]
    pos = torch.cat([coded.first_position[:, None].long() + torch.arange(n), fpos.long()], 1)
    cos, sin = (t.double().view(bsz, -1, L, pairs)[:, :, None, None] for t in rope_angles(pos, d, theta))
    xa, xb = qa[:, None] * cos + qb[:, None] * sin, qb[:, None] * cos - qa[:, None] * sin  # [B, S, H, qg, L, pairs]
    ka, kb = keys.view(*keys.shape[:4], 2, pairs).unbind(4)
    scores = (ka[:, :, :, None] * xa + kb[:, :, :, None] * xb).sum((-1, -2)) / math.sqrt(d)  # [B, S, H, qg]
    if mask is not None:
        keep = torch.cat([torch.ones(bsz, n, dtype=torch.bool), mask], 1)
        scores = scores.masked_fill(~keep[:, :, None, None], float("-inf"))
    out_lane = torch.einsum("bshg,bshd->bhgd", scores.softmax(1), values.flatten(3))
    out = torch.empty_like(out_lane)
    out.scatter_(3, vch[None, :, None, :].expand(bsz, -1, qg, -1), out_lane)
    return out.reshape(bsz, hq, d)


def pad_the_last_row_too(monkeypatch) -> None:
    """check()'s inputs (make_inputs pads row 0 only) with the last row padded like row 0 as well: with several
    rows per pass it lies in a later pass (or later in the first)."""
    make = test_decode_attention.make_inputs

    def padded(*args, **kwargs):
        coded, q, fk, fv, fpos, mask = make(*args, **kwargs)
        if mask is not None and mask.shape[0] > 1:
            pad, half = int((~mask[0]).sum()), fpos.shape[1] // 2
            mask[-1, :pad] = False
            fpos[-1, :pad] = 0
            fpos[-1, pad:half] = torch.arange(half - pad)
        return coded, q, fk, fv, fpos, mask

    monkeypatch.setattr(test_decode_attention, "make_inputs", padded)


def test_the_last_rows_padding_is_masked(monkeypatch):
    """The inputs of pad_the_last_row_too: rows 0 and 2 padded, row 1 not; the emulated kernel gives the masked
    reference, and the mask changes exactly the padded rows."""
    pad_the_last_row_too(monkeypatch)
    kc, vc = make_codecs("tasq+loopvq", 2, 64, 16, 8, 4, seed=5)
    coded, q, fk, fv, fpos, mask = test_decode_attention.make_inputs(kc, vc, 3, 2, 23, 6, seed=5, pad=2)
    assert mask[:, :2].tolist() == [[False, False], [True, True], [False, False]] and mask[:, 2:].all()
    assert fpos[2, :3].tolist() == fpos[0, :3].tolist() == [0, 0, 0]  # sinks: pads at 0, then positions from 0
    tables = da.step_tables(kc, vc, 1, "half", "cpu", torch.float32)
    got = emulate(q, tables, coded, fk, fv, fpos, mask, 1e4, 16)
    ref = da.decode_attention_reference(q, kc, vc, 1, coded, fk, fv, fpos, mask, "half", 1e4)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    unmasked = da.decode_attention_reference(q, kc, vc, 1, coded, fk, fv, fpos, None, "half", 1e4)
    changed = [not torch.allclose(ref[b], unmasked[b]) for b in range(3)]
    assert changed == [True, False, True]


@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("q_heads, lanes", [(2, 8), (2, 16), (6, 8)])
def test_lane_tables_give_the_reference_attention(method, style, q_heads, lanes):
    kc, vc = make_codecs(method, 2, 64, 16, 8, 4, seed=4)
    coded, q, fk, fv, fpos, mask = make_inputs(kc, vc, 2, q_heads, 23, 6, seed=4, pad=2)
    for step in range(kc.layout.steps):
        tables = da.step_tables(kc, vc, step, style, "cpu", torch.float32)
        got = emulate(q, tables, coded, fk, fv, fpos, mask, 1e4, lanes)
        ref = da.decode_attention_reference(q, kc, vc, step, coded, fk, fv, fpos, mask, style, 1e4)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6, (method, style, step)  # float32 tables and angles


def test_run_lengths_of_known_layouts():
    """Loop-axis codes hold c = G / T_c consecutive channels of a step. Half-split RoPE: a lane's first channels
    (D/32 consecutive ones) come from one code when c >= D/32, so key runs of min(c, D/32) holding one channel
    of each pair; interleaved RoPE: a code holds whole pairs, runs of min(c, D/16) holding both channels (a run
    of the whole lane counts as unmixed); values
    in runs of min(c, D/16). The lane table keeps every value."""
    for g, steps, style, run_key, mixed, run_value in (
            (16, 4, "half", 4, False, 4), (8, 4, "half", 2, False, 2), (4, 4, "half", 1, False, 1),
            (32, 4, "half", 4, False, 8), (16, 4, "interleaved", 4, True, 4), (32, 4, "interleaved", 8, False, 8)):
        kc, vc = make_codecs("loopvq", 2, 128, 16, g, steps)
        tables = da.step_tables(kc, vc, 1, style, "cpu", torch.float32)
        lanes = dc.lane_tables(tables, 16)
        assert (lanes.run_key, lanes.key_mixed, lanes.run_value) == (run_key, mixed, run_value), (g, style)
        assert lanes.key.shape == (2, 8 // run_key, 16, 16, run_key)
        regs = torch.tensor(dc.key_registers(8, run_key, mixed))
        key = torch.empty(2, 16, 16, 8)  # [H, K, lane, register]
        key[..., regs] = lanes.key.permute(0, 2, 3, 1, 4).reshape(2, 16, 16, 8)
        full = torch.empty(2, 16, 128)
        full.scatter_(2, lanes.key_channel[:, None, :].long().expand(-1, 16, -1), key.reshape(2, 16, 128))
        a, b = pair_channels(128, style)
        expect = torch.empty(2, 16, 128)
        expect[:, :, a], expect[:, :, b] = tables.key_a, tables.key_b
        assert torch.equal(full, expect), (g, style)



gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_every_method_and_rope_style(method, style, lanes):
    check(method, style, heads=2, q_heads=2, n=77, s_fp=6, d=64, k=32, g=8, splits=3, pad=2, backend="cuda",
          lanes_per_token=lanes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, s_fp, splits, tokens, warps, lanes", [
    (0, 1, None, 8, 8, 8), (1, 3, None, 8, 8, 16), (15, 4, 2, 4, 4, 8), (16, 20, 1, 8, 8, 16), (129, 2, 3, 16, 8, 16),
    (300, 12, 5, 2, 20, 8), (1000, 9, None, 8, 16, 8), (77, 5, 2, 8, 12, 16), (2000, 40, 3, 1, 8, 8),
    (999, 7, 2, 8, 16, 16),
])
def test_kernel_tile_split_and_region_boundaries(n, s_fp, splits, tokens, warps, lanes):
    check("loopvq", "half", heads=2, q_heads=2, n=n, s_fp=s_fp, d=128, k=64, g=16, splits=splits, seed=n,
          backend="cuda", tokens_per_iteration=tokens, warps=warps, lanes_per_token=lanes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method, style, d, lanes", [
    ("loopvq", "half", 96, 16), ("tasq+loopvq", "interleaved", 64, 16), ("loopvq", "interleaved", 128, 8)])
def test_kernel_gqa_and_huginn_head_dim(method, style, d, lanes):
    check(method, style, heads=2, q_heads=6, n=50, s_fp=5, d=d, k=32, g=8, splits=2, seed=3, backend="cuda",
          lanes_per_token=lanes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows, batch, warps", [(2, 3, 16), (4, 2, 16), (2, 5, 8), (4, 5, 12), (8, 8, 16), (8, 11, 16)])
def test_kernel_serves_several_rows_per_pass(rows, batch, warps, monkeypatch):
    """Rows per pass: the block's warps split over batch rows (a last pass with fewer rows, left padding in the
    first row and the last)."""
    pad_the_last_row_too(monkeypatch)
    check("tasq+loopvq", "half", heads=2, q_heads=2, n=333, s_fp=9, d=128, k=64, g=16, splits=2, pad=2, batch=batch,
          seed=rows + batch, backend="cuda", rows_per_pass=rows, warps=warps)


@pytest.mark.gpu
@gpu
def test_kernel_with_tables_copied_by_plain_loads(monkeypatch):
    """TABLE_ASYNC off (the comparison build of bench_decode's ``s`` variants): the same attention (left
    padding in rows 0 and 2, two passes)."""
    monkeypatch.setattr(dc, "TABLE_ASYNC", False)
    pad_the_last_row_too(monkeypatch)
    check("loopvq", "half", heads=2, q_heads=2, n=333, s_fp=9, d=128, k=64, g=16, splits=2, pad=2, batch=3,
          backend="cuda", rows_per_pass=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method, lanes, key_float32, rows", [
    ("loopvq", 8, None, 1), ("loopvq", 16, None, 1), ("loopvq", 16, True, 2), ("loopvq", 16, True, None),
    ("loopvq", 16, None, 2),
    ("tasq+loopvq", 8, None, 1), ("tasq+loopvq", 16, None, 8)])
def test_kernel_at_ouro_shapes_in_fp16_tables_and_bf16(method, lanes, key_float32, rows, monkeypatch):
    """fp16 tables, bf16 query and tokens; keys read as packed halves (or widened to fp32) and values summed in
    packed halves over a warp step: relative error within the fp16 tolerance (rows 0 and 7 left-padded). The
    plans launched (from decode_cuda.launch) have the rows and the float32 key table asked for."""
    pad_the_last_row_too(monkeypatch)
    plans, plan_of = [], dc.launch
    monkeypatch.setattr(dc, "launch", lambda *args: plans.append(plan_of(*args)) or plans[-1])
    check(method, "half", heads=16, q_heads=16, n=3000, s_fp=72, d=128, k=256, g=16, table_dtype=torch.float16,
          dtype=torch.bfloat16, tol=1e-2, backend="cuda", lanes_per_token=lanes, key_float32=key_float32,
          rows_per_pass=rows, batch=8, pad=2)
    assert plans and all(isinstance(p, dc.LaunchPlan) and p.rows == (rows or p.rows) for p in plans)
    assert not key_float32 or all(p.key_float32 for p in plans)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method, style, q_heads, lanes, tokens, n, pad", [
    ("loopvq", "half", 2, 16, 8, 1237, 0), ("loopvq", "half", 2, 8, 4, 1237, 2),
    ("loopvq", "interleaved", 6, 16, 4, 1101, 2), ("loopvq", "interleaved", 6, 8, 2, 1101, 0),
    ("tasq+loopvq", "half", 4, 16, 8, 999, 2)])
def test_kernel_fp16_tables_over_many_anchors_per_warp(method, style, q_heads, lanes, tokens, n, pad):
    """The default fp16 path (Chebyshev query recurrence re-anchored every 4 warp steps, packed-half key and
    value sums) far past a warp's first anchor: one split and 2 warps, so each warp walks n/2 tokens, 8 or 16
    per step: 8 to 18 anchors per warp; GQA, interleaved RoPE, masked padding, a partial last step."""
    check(method, style, heads=2, q_heads=q_heads, n=n, s_fp=9, d=128, k=64, g=16, splits=1, pad=pad, seed=n,
          table_dtype=torch.float16, dtype=torch.bfloat16, tol=1e-2, backend="cuda", warps=2,
          tokens_per_iteration=tokens, lanes_per_token=lanes)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_fp16_tables_with_large_biased_keys(lanes):
    """Keys with near-constant channels around 10, queries of scale 5 (q . k of a few hundred): fp16 tables and
    bf16 inputs alone give 6.4e-3 at the first step (the Triton kernel on the CPU, fp32 sums); the packed-half key
    dot product adds its own rounding, so the bound is 2e-2, not 1e-2."""
    check("loopvq", "half", heads=2, q_heads=2, n=700, s_fp=9, d=128, k=64, g=16, splits=1, pad=2, seed=5,
          table_dtype=torch.float16, dtype=torch.bfloat16, tol=2e-2, backend="cuda", warps=2, lanes_per_token=lanes,
          key_bias=10.0, q_scale=5.0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_fp16_keys_with_fp32_values(lanes):
    """Values of a few thousand: fp32 value table (fp32 value sums, angle addition instead of the recurrence)
    next to the fp16 key table's packed-half dot product."""
    check("loopvq", "half", heads=2, q_heads=2, n=300, s_fp=9, d=128, k=64, g=16, splits=1, pad=2, seed=6,
          table_dtype=torch.float16, dtype=torch.bfloat16, tol=1e-2, backend="cuda", warps=2, lanes_per_token=lanes,
          value_scale=2000.0)
