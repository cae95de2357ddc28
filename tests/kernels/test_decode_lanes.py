"""The step tables in lane order (loopvq_calib/decode_lanes.py), on CPU: an independent float64 emulation of
the CUDA kernel's reads (each lane's runs at the kernel's shared-memory offsets, its registers, RoPE pairs and
value channels) against the reference attention, for every method, both RoPE styles and GQA; the run lengths
and index groups of known layouts; the sites it leaves to Triton."""

from __future__ import annotations

import pytest
import torch
from support.decode import emulate, make_codecs, make_inputs

from loopvq_calib.kernels import decode_lanes as dl
from loopvq_calib.models.common import pair_channels
from loopvq_calib.serving import decode_attention as da


@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq", "tasq+loopvq channels"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("q_heads, lanes", [(2, 8), (2, 16), (6, 8)])
def test_lane_tables_give_the_reference_attention(method, style, q_heads, lanes):
    """``tasq+loopvq channels``: a channels layout of 2 RoPE pairs per code and step (its pairs permuted)."""
    name, _, grouping = method.partition(" ")
    kc, vc = make_codecs(name, 2, 64, 16, 16 if grouping else 8, 4, seed=4, grouping=grouping or "free", style=style)
    coded, q, fk, fv, fpos, mask = make_inputs(kc, vc, 2, q_heads, 23, 6, seed=4, pad=2)
    for step in range(kc.layout.steps):
        tables = da.step_tables(kc, vc, step, rope_style=style, device="cpu", dtype=torch.float32)
        got = emulate(q, tables, coded, fk, fv, fpos, mask, 1e4, lanes)
        ref = da.decode_attention_reference(
            q,
            kc,
            vc,
            step=step,
            coded=coded,
            fp_keys=fk,
            fp_values=fv,
            fp_positions=fpos,
            fp_mask=mask,
            rope_style=style,
            rope_theta=1e4,
        )
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6, (method, style, step)  # float32 tables and angles


def test_run_lengths_of_known_layouts():
    """Loop-axis codes hold c = G / T_c consecutive channels of a step. Half-split RoPE: a lane's first channels
    (D/32 consecutive ones) come from one code when c >= D/32, so key runs of min(c, D/32) holding one channel
    of each pair; interleaved RoPE: a code holds whole pairs, runs of min(c, D/16) holding both channels (a run
    of the whole lane counts as unmixed); values
    in runs of min(c, D/16). The lane table keeps every value."""
    for g, steps, style, run_key, mixed, run_value in (
        (16, 4, "half", 4, False, 4),
        (8, 4, "half", 2, False, 2),
        (4, 4, "half", 1, False, 1),
        (32, 4, "half", 4, False, 8),
        (16, 4, "interleaved", 4, True, 4),
        (32, 4, "interleaved", 8, False, 8),
    ):
        kc, vc = make_codecs("loopvq", 2, 128, 16, g, steps)
        tables = da.step_tables(kc, vc, 1, rope_style=style, device="cpu", dtype=torch.float32)
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
    lanes = dl.lane_tables(da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float16), 8)
    assert (lanes.run_key, lanes.key_group, lanes.run_value, lanes.value_group) == (4, 2, 4, 4)
    assert lanes.key_column[0, 3].tolist() == [6, 7, 22, 23] and lanes.value_column[0, 3].tolist() == [12, 13, 14, 15]
    kc, vc = make_codecs("tasq+loopvq", 2, 128, 16, 16, 4)
    lanes = dl.lane_tables(da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float16), 8)
    assert (lanes.run_key, lanes.key_group, lanes.value_group) == (1, 1, 4)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_channels_layouts_read_runs_as_long_as_loopvqs(style):
    """Ouro's shapes (D 128, G 16, T_c 4: 2 RoPE pairs per code and step), 16 lanes: with the pairs in code order a
    lane's 4 pairs are 2 codes, each a run of 4 holding both channels of 2 pairs (LoopVQ: 2 runs of 4 too), their
    index bytes adjacent (read in one load); each lane's cos/sin columns are its pairs' (the pair map). A free
    TaSQ layout reads runs of 1 through no map."""
    kc, vc = make_codecs("tasq+loopvq", 2, 128, 16, 16, 4, grouping="channels", style=style)
    tables = da.step_tables(kc, vc, 1, rope_style=style, device="cpu", dtype=torch.float16)
    lanes = dl.lane_tables(tables, 16)
    assert (lanes.run_key, lanes.key_mixed, lanes.key_group, lanes.run_value) == (4, True, 2, 4)
    assert torch.equal(lanes.key_pair, tables.key_pairs)
    a, _ = pair_channels(128, style)
    first = lanes.key_channel.view(2, 16, 2, 4)[:, :, 0].reshape(2, 64)  # the first channel of every lane's pairs
    assert torch.equal(first.long(), a[lanes.key_pair.long()])
    kc, vc = make_codecs("tasq+loopvq", 2, 128, 16, 16, 4)
    free = dl.lane_tables(da.step_tables(kc, vc, 1, rope_style=style, device="cpu", dtype=torch.float16), 16)
    assert (free.run_key, free.key_pair) == (1, None)


def test_head_dims_that_are_no_multiple_of_32_are_left_to_triton():
    kc, vc = make_codecs("loopvq", 2, 24, 16, 8, 4)
    assert dl.lane_tables(da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float32)) is None
