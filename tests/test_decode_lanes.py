"""The step tables in lane order (loopvq_calib/decode_lanes.py), on CPU: an independent float64 emulation of
the CUDA kernel's reads (each lane's runs at the kernel's shared-memory offsets, its registers, RoPE pairs and
value channels) against the reference attention, for every method, both RoPE styles and GQA; the run lengths
and index groups of known layouts; the sites it leaves to Triton."""

from __future__ import annotations

import math

import pytest
import torch

from loopvq_calib import decode_attention as da
from loopvq_calib import decode_lanes as dl
from loopvq_calib.models.common import pair_channels, rope_angles
from test_decode_attention import make_codecs, make_inputs


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
    lanes = dl.lane_tables(tables, lane_count)
    bsz, hq, d = q.shape
    L = lane_count
    heads, n, per, pairs = lanes.key.shape[0], coded.count, d // L, d // (2 * L)
    qg = hq // heads
    regs = torch.tensor(dl.key_registers(per, lanes.run_key, lanes.key_mixed))
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
        lanes = dl.lane_tables(tables, 16)
        assert (lanes.run_key, lanes.key_mixed, lanes.run_value) == (run_key, mixed, run_value), (g, style)
        assert lanes.key.shape == (2, 8 // run_key, 16, 16, run_key)
        regs = torch.tensor(dl.key_registers(8, run_key, mixed))
        key = torch.empty(2, 16, 16, 8)  # [H, K, lane, register]
        key[..., regs] = lanes.key.permute(0, 2, 3, 1, 4).reshape(2, 16, 16, 8)
        full = torch.empty(2, 16, 128)
        full.scatter_(2, lanes.key_channel[:, None, :].long().expand(-1, 16, -1), key.reshape(2, 16, 128))
        a, b = pair_channels(128, style)
        expect = torch.empty(2, 16, 128)
        expect[:, :, a], expect[:, :, b] = tables.key_a, tables.key_b
        assert torch.equal(full, expect), (g, style)


def test_index_bytes_read_together_at_ouro_shapes():
    """With 8 lanes per token a loop-axis lane reads codes 2m, 2m+1 (first channels) and 2m+16, 2m+17 (second
    channels) of the keys: two 16-bit loads; values 4m .. 4m+3: one 32-bit load. TaSQ's permuted keys: bytes."""
    kc, vc = make_codecs("loopvq", 2, 128, 16, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 1, "half", "cpu", torch.float16), 8)
    assert (lanes.run_key, lanes.key_group, lanes.run_value, lanes.value_group) == (4, 2, 4, 4)
    assert lanes.key_column[0, 3].tolist() == [6, 7, 22, 23] and lanes.value_column[0, 3].tolist() == [12, 13, 14, 15]
    kc, vc = make_codecs("tasq+loopvq", 2, 128, 16, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 1, "half", "cpu", torch.float16), 8)
    assert (lanes.run_key, lanes.key_group, lanes.value_group) == (1, 1, 4)


def test_head_dims_that_are_no_multiple_of_32_are_left_to_triton():
    kc, vc = make_codecs("loopvq", 2, 24, 16, 8, 4)
    assert dl.lane_tables(da.step_tables(kc, vc, 0, "half", "cpu", torch.float32)) is None
