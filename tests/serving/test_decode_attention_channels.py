"""Decode attention of TaSQ channels layouts (``tasq.grouping: channels``) through the LoopVQ path: the step tables
put each code's RoPE pairs side by side (``StepTables.key_pairs``) and the kernels rotate the query by each slot's
pair. Checked against the float64 reference (codec decode + RoPE + softmax): the Triton kernel on CPU tensors under
``TRITON_INTERPRET=1`` (or a GPU), the CUDA kernel on a GPU (``gpu``); free layouts keep pair i in slot i."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE, make_tiny_ouro, needs_triton_kernels as needs_kernels
from support.decode import channels_groups, check, gen, make_codecs, make_inputs
from support.quantizers import sampled_quantizer

from loopvq_calib.kernels import decode_cuda_plan as dcp
from loopvq_calib.models.common import pair_channels
from loopvq_calib.serving import decode_attention as da
from loopvq_calib.serving.cache import QuantizedLoopKVCache

CUDA = torch.cuda.is_available()


@needs_kernels
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("q_heads, g", [(2, 16), (6, 16), (2, 32)])
def test_triton_kernel_reads_channels_layouts_like_the_reference(style, q_heads, g):
    """Codes of 2 or 4 RoPE pairs at each of 4 steps, MHA and GQA, masked left padding, several splits."""
    check(
        "tasq+loopvq",
        style,
        heads=2,
        q_heads=q_heads,
        n=29,
        s_fp=6,
        d=32,
        g=g,
        splits=3,
        pad=2,
        seed=g + q_heads,
        grouping="channels",
    )


@needs_kernels
def test_triton_kernel_channels_layout_in_fp16_tables_and_bf16():
    check(
        "tasq+loopvq",
        "half",
        heads=2,
        q_heads=4,
        n=30,
        s_fp=7,
        d=32,
        g=16,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        seed=11,
        grouping="channels",
    )


@needs_kernels
def test_triton_kernel_channels_layout_with_a_padded_head_dim():
    """Huginn-like head dim 24 (padded to 32 inside the kernel), interleaved RoPE."""
    check(
        "tasq+loopvq",
        "interleaved",
        heads=2,
        q_heads=2,
        n=19,
        s_fp=5,
        d=24,
        g=16,
        splits=2,
        seed=9,
        grouping="channels",
    )


@needs_kernels
def test_the_pair_map_is_what_makes_the_permuted_tables_right():
    """The same permuted tables without their pair map (the query rotated as if slot i held pair i) miss the
    reference by far: the kernel reads ``key_pairs``."""
    kc, vc = make_codecs("tasq+loopvq", 2, 32, 16, 16, 4, grouping="channels", style="half", seed=2)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 17, 5, seed=2)
    tables = da.step_tables(kc, vc, 1, rope_style="half", device=DEVICE, dtype=torch.float32)
    ref = da.decode_attention_reference(
        q,
        kc,
        vc,
        step=1,
        coded=coded,
        fp_keys=fk,
        fp_values=fv,
        fp_positions=fpos,
        fp_mask=None,
        rope_style="half",
        rope_theta=1e4,
    )
    fp = da.FullPrecisionTokens(fk.to(DEVICE), fv.to(DEVICE), fpos.to(DEVICE))
    moved = da.CodedTokens(
        coded.key_indices.to(DEVICE),
        coded.value_indices.to(DEVICE),
        coded.key_sigma.to(DEVICE),
        coded.count,
        coded.first_position,
    )

    def error() -> float:
        out = da.decode_attention(q.to(DEVICE), tables, moved, fp=fp, rope=da.RopeTable(32, 1e4), backend="triton")
        return ((out.cpu().double() - ref).norm() / ref.norm()).item()

    assert error() < 1e-5
    tables.key_pairs = None
    assert error() > 1e-2


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_channels_tables_hold_each_codes_pairs_side_by_side(style):
    """Slot s of a channels layout's key tables holds RoPE pair key_pairs[h, s]: its channels' values of the
    channel table and their code; every code's c/2 pairs are consecutive slots (a permutation of all pairs)."""
    d, g, steps = 32, 16, 4
    kc, vc = make_codecs("tasq+loopvq", 2, d, 16, g, steps, grouping="channels", style=style, seed=5)
    a, b = pair_channels(d, style)
    for step in range(steps):
        tables = da.step_tables(kc, vc, step, rope_style=style, device="cpu", dtype=torch.float32)
        table, code = da.channel_table(kc, step)
        pairs = tables.key_pairs.long()
        assert all(sorted(p) == list(range(d // 2)) for p in pairs.tolist())
        assert pairs.tolist() != [list(range(d // 2))] * 2
        for h in range(2):
            assert torch.equal(tables.key_a[h], table[h][:, a[pairs[h]]])
            assert torch.equal(tables.key_b[h], table[h][:, b[pairs[h]]])
            assert torch.equal(tables.key_code_a[h].long(), code[h, a[pairs[h]]])
            assert torch.equal(tables.key_code_a[h], tables.key_code_b[h])  # a code holds whole pairs
        per_code = g // steps // 2
        runs = tables.key_code_a.view(2, -1, per_code)
        assert (runs == runs[..., :1]).all() and all(len(set(r)) == len(r) for r in runs[..., 0].tolist())


@pytest.mark.parametrize("method", ["tasq", "tasq+loopvq", "loopvq"])
def test_free_and_loop_axis_layouts_keep_pair_i_in_slot_i(method):
    """A free TaSQ layout (any permutation) and the half-split loop-axis layout are no channels layouts: their
    tables are what they were (pair i's channels in slot i, no pair map)."""
    kc, vc = make_codecs(method, 2, 32, 16, 16, 4, seed=3)
    a, b = pair_channels(32, "half")
    tables = da.step_tables(kc, vc, 0, rope_style="half", device="cpu", dtype=torch.float32)
    table, code = da.channel_table(kc, 0)
    assert tables.key_pairs is None
    assert torch.equal(tables.key_a, table[:, :, a]) and torch.equal(tables.key_b, table[:, :, b])
    assert torch.equal(tables.key_code_a.long(), code[:, a]) and torch.equal(tables.key_code_b.long(), code[:, b])


def test_one_pair_per_code_in_pair_order_needs_no_map():
    """G = 2 T: each code holds one pair; codes sorted by first coordinate already hold pair i in slot i."""
    kc, vc = make_codecs("tasq+loopvq", 2, 32, 16, 8, 4, grouping="channels", style="half", seed=1)
    assert da.pair_order(kc.layout, "half") is None
    assert da.step_tables(kc, vc, 2, rope_style="half", device="cpu", dtype=torch.float32).key_pairs is None


@needs_kernels
def test_the_cache_decodes_a_channels_quantizer_through_the_kernel_as_its_reference_path():
    """A tiny Ouro (half-split RoPE, head dim 16) with TaSQ+LoopVQ keys in channels layouts (G 16: 2 pairs per
    code and step): greedy decoding through the Triton kernel gives the reference path's tokens, logits within
    1e-4; the kernel's step tables carry the pair map."""
    model = make_tiny_ouro().to(DEVICE)
    prompt = torch.randint(0, 4096, (1, 17), generator=gen(2))
    q = sampled_quantizer(model, prompt.to(DEVICE), "tasq+loopvq", codebook_size=16, group_size=16, steps_per_block=4)
    for codec in q.codecs.values():
        lay = codec.layout
        if lay.kind == "key":
            lay.groups = channels_groups(lay.kv_heads, lay.steps, lay.head_dim, 16, "half", seed=3).to(DEVICE)
    runs = {}
    for backend in ("triton", "torch"):
        cache = QuantizedLoopKVCache(q, sink_tokens=4, recent_window=4, page_size=4, backend=backend)
        out = model(prompt.to(DEVICE), cache=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for _ in range(4):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
        runs[backend] = (torch.stack(logits, 1), cache)
    (kernel, cache), (reference, _) = runs["triton"], runs["torch"]
    assert cache.regions()["encoded"] == 12
    assert all(t.key_pairs is not None for t in cache._kernel_state.tables.values())
    assert torch.equal(kernel.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(kernel, reference, atol=1e-4, rtol=1e-4)


# -- the CUDA kernel (GPU) ------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("q_heads, lanes", [(2, 8), (2, 16), (6, 16)])
def test_cuda_kernel_reads_channels_layouts_like_the_reference(style, q_heads, lanes):
    check(
        "tasq+loopvq",
        style,
        heads=2,
        q_heads=q_heads,
        n=777,
        s_fp=6,
        d=128,
        k=32,
        g=16,
        splits=3,
        pad=2,
        seed=lanes + q_heads,
        backend="cuda",
        lanes_per_token=lanes,
        grouping="channels",
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_cuda_kernel_channels_at_ouro_shapes_takes_loopvqs_launch(style, monkeypatch):
    """Ouro-1.4B's site shapes, fp16 tables and bf16 inputs: within the fp16 tolerance, and the default plan is
    LoopVQ's (16 tokens per lane group and step, fp16 keys), not free TaSQ's (8 tokens, float32 keys)."""
    plans, plan_of = [], dcp.launch
    monkeypatch.setattr(dcp, "launch", lambda *args, **kwargs: plans.append(plan_of(*args, **kwargs)) or plans[-1])
    check(
        "tasq+loopvq",
        style,
        heads=16,
        q_heads=16,
        n=3000,
        s_fp=72,
        d=128,
        k=256,
        g=16,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        backend="cuda",
        batch=8,
        pad=2,
        grouping="channels",
    )
    assert plans and all(isinstance(p, dcp.LaunchPlan) and (p.tokens, p.key_float32) == (16, False) for p in plans)


@pytest.mark.gpu
@gpu
def test_cuda_kernel_channels_layout_fp16_over_many_anchors():
    """The Chebyshev recurrence re-anchored through the pair map far past a warp's first anchor (one split, 2
    warps), GQA, a partial last step."""
    check(
        "tasq+loopvq",
        "half",
        heads=2,
        q_heads=4,
        n=999,
        s_fp=9,
        d=128,
        k=64,
        g=16,
        splits=1,
        pad=2,
        seed=4,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        backend="cuda",
        warps=2,
        tokens_per_iteration=8,
        grouping="channels",
    )
