"""The shared-memory CUDA decode kernel (kernels/decode_cuda.py + its CUDA source).

On a GPU (``gpu``): the kernel itself against the reference (tolerances as in test_decode_attention.py: 1e-5
with float32 tables and inputs, 1e-2 with float16 tables and bf16 inputs), its in-kernel split merge under
CUDA-graph replay. On CPU: the padded inputs those tests use (the lane tables: test_decode_lanes.py; the launch
plan and the calls it refuses: test_decode_cuda.py)."""

from __future__ import annotations

import pytest
import support.decode as decode_cases
import torch
from support.decode import check, emulate, make_codecs

from loopvq_calib.kernels import cuda_build, decode_cuda_plan as dcp
from loopvq_calib.runtime.devices import indexed_device
from loopvq_calib.serving import decode_attention as da

CUDA = torch.cuda.is_available()


def pad_the_last_row_too(monkeypatch) -> None:
    """check()'s inputs (make_inputs pads row 0 only) with the last row padded like row 0 as well: with several
    rows per pass it lies in a later pass (or later in the first)."""
    make = decode_cases.make_inputs

    def padded(*args, **kwargs):
        coded, q, fk, fv, fpos, mask = make(*args, **kwargs)
        if mask is not None and mask.shape[0] > 1:
            pad, half = int((~mask[0]).sum()), fpos.shape[1] // 2
            mask[-1, :pad] = False
            fpos[-1, :pad] = 0
            fpos[-1, pad:half] = torch.arange(half - pad)
        return coded, q, fk, fv, fpos, mask

    monkeypatch.setattr(decode_cases, "make_inputs", padded)


def test_the_last_rows_padding_is_masked(monkeypatch):
    """The inputs of pad_the_last_row_too: rows 0 and 2 padded, row 1 not; the emulated kernel gives the masked
    reference, and the mask changes exactly the padded rows."""
    pad_the_last_row_too(monkeypatch)
    kc, vc = make_codecs("tasq+loopvq", 2, 64, 16, 8, 4, seed=5)
    coded, q, fk, fv, fpos, mask = decode_cases.make_inputs(kc, vc, 3, 2, 23, 6, seed=5, pad=2)
    assert mask[:, :2].tolist() == [[False, False], [True, True], [False, False]] and mask[:, 2:].all()
    assert fpos[2, :3].tolist() == fpos[0, :3].tolist() == [0, 0, 0]  # sinks: pads at 0, then positions from 0
    tables = da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float32)
    got = emulate(q, tables, coded, fk, fv, fpos, mask, 1e4, 16)
    ref = da.decode_attention_reference(
        q,
        kc,
        vc,
        step=1,
        coded=coded,
        fp_keys=fk,
        fp_values=fv,
        fp_positions=fpos,
        fp_mask=mask,
        rope_style="half",
        rope_theta=1e4,
    )
    assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    unmasked = da.decode_attention_reference(
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
    changed = [not torch.allclose(ref[b], unmasked[b]) for b in range(3)]
    assert changed == [True, False, True]


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_every_method_and_rope_style(method, style, lanes):
    check(
        method,
        style,
        heads=2,
        q_heads=2,
        n=77,
        s_fp=6,
        d=64,
        k=32,
        g=8,
        splits=3,
        pad=2,
        backend="cuda",
        lanes_per_token=lanes,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "n, s_fp, splits, tokens, warps, lanes",
    [
        (0, 1, None, 8, 8, 8),
        (1, 3, None, 8, 8, 16),
        (15, 4, 2, 4, 4, 8),
        (16, 20, 1, 8, 8, 16),
        (129, 2, 3, 16, 8, 16),
        (300, 12, 5, 2, 20, 8),
        (1000, 9, None, 8, 16, 8),
        (77, 5, 2, 8, 12, 16),
        (2000, 40, 3, 1, 8, 8),
        (999, 7, 2, 8, 16, 16),
    ],
)
def test_kernel_tile_split_and_region_boundaries(n, s_fp, splits, tokens, warps, lanes):
    check(
        "loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=n,
        s_fp=s_fp,
        d=128,
        k=64,
        g=16,
        splits=splits,
        seed=n,
        backend="cuda",
        tokens_per_iteration=tokens,
        warps=warps,
        lanes_per_token=lanes,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "method, style, d, lanes",
    [("loopvq", "half", 96, 16), ("tasq+loopvq", "interleaved", 64, 16), ("loopvq", "interleaved", 128, 8)],
)
def test_kernel_gqa_and_huginn_head_dim(method, style, d, lanes):
    check(
        method,
        style,
        heads=2,
        q_heads=6,
        n=50,
        s_fp=5,
        d=d,
        k=32,
        g=8,
        splits=2,
        seed=3,
        backend="cuda",
        lanes_per_token=lanes,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows, batch, warps", [(2, 3, 16), (4, 2, 16), (2, 5, 8), (4, 5, 12), (8, 8, 16), (8, 11, 16)])
def test_kernel_serves_several_rows_per_pass(rows, batch, warps, monkeypatch):
    """Rows per pass: the block's warps split over batch rows (a last pass with fewer rows, left padding in the
    first row and the last)."""
    pad_the_last_row_too(monkeypatch)
    check(
        "tasq+loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=333,
        s_fp=9,
        d=128,
        k=64,
        g=16,
        splits=2,
        pad=2,
        batch=batch,
        seed=rows + batch,
        backend="cuda",
        rows_per_pass=rows,
        warps=warps,
    )


@pytest.mark.gpu
@gpu
def test_the_split_merge_in_the_kernel_survives_graph_replays():
    """The last split of each (row, head) merges and resets its counter: a CUDA graph of the call replayed
    three times over changed queries gives the reference each time, and the counters are zero after each."""
    kc, vc = make_codecs("loopvq", 2, 128, 64, 16, 4, seed=8)
    coded, q, fk, fv, fpos, mask = decode_cases.make_inputs(kc, vc, 3, 2, 700, 9, seed=8, pad=2)
    dev = torch.device("cuda")
    tables = da.step_tables(kc, vc, 1, rope_style="half", device=dev, dtype=torch.float32)
    store = decode_cases.head_major
    moved = da.CodedTokens(
        store(coded.key_indices).to(dev), store(coded.value_indices).to(dev), None, 700, coded.first_position.to(dev)
    )  # no host copy inside the capture
    qd, fkd, fvd, fposd, maskd = (t.to(dev) for t in (q, fk, fv, fpos, mask))
    rope = da.RopeTable(128, 10000.0)

    def call() -> torch.Tensor:
        return da.decode_attention(
            qd,
            tables,
            moved,
            fp=da.FullPrecisionTokens(fkd, fvd, fposd, maskd),
            rope=rope,
            max_position=2000,
            backend="cuda",
            cuda=da.CudaDecodeLaunch(num_splits=5, rows_per_pass=2),
        )

    call()  # builds the kernel and the split counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for i in range(3):
        qd.copy_((q * (1 + i)).to(dev))
        graph.replay()
        torch.cuda.synchronize()
        ref = da.decode_attention_reference(
            q * (1 + i),
            kc,
            vc,
            step=1,
            coded=coded,
            fp_keys=fk,
            fp_values=fv,
            fp_positions=fpos,
            fp_mask=mask,
            rope_style="half",
            rope_theta=10000.0,
        )
        assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5, i
        assert int(cuda_build.BUILDS.counters(indexed_device(dev), 6).count_nonzero()) == 0, i


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "method, lanes, key_float32, rows",
    [
        ("loopvq", 8, None, 1),
        ("loopvq", 16, None, 1),
        ("loopvq", 16, True, 2),
        ("loopvq", 16, True, None),
        ("loopvq", 16, None, 2),
        ("loopvq", 16, None, None),
        ("tasq+loopvq", 8, None, 1),
        ("tasq+loopvq", 16, None, 8),
        ("tasq+loopvq", 16, None, None),
    ],
)
def test_kernel_at_ouro_shapes_in_fp16_tables_and_bf16(method, lanes, key_float32, rows, monkeypatch):
    """fp16 tables, bf16 query and tokens; keys read as packed halves (or widened to fp32) and values summed in
    packed halves over a warp step: relative error within the fp16 tolerance (rows 0 and 7 left-padded). The
    plans launched (from decode_cuda_plan.launch) have the rows and the float32 key table asked for; at the defaults
    16 tokens per lane group and step with fp16 keys, 8 with TaSQ's float32 keys."""
    pad_the_last_row_too(monkeypatch)
    plans, plan_of = [], dcp.launch
    monkeypatch.setattr(dcp, "launch", lambda *args, **kwargs: plans.append(plan_of(*args, **kwargs)) or plans[-1])
    check(
        method,
        "half",
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
        lanes_per_token=lanes,
        key_float32=key_float32,
        rows_per_pass=rows,
        batch=8,
        pad=2,
    )
    assert plans and all(isinstance(p, dcp.LaunchPlan) and p.rows == (rows or p.rows) for p in plans)
    assert not key_float32 or all(p.key_float32 for p in plans)
    if rows is None and key_float32 is None:
        assert all((p.tokens, p.key_float32) == ((8, True) if method == "tasq+loopvq" else (16, False)) for p in plans)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "method, style, q_heads, lanes, tokens, n, pad",
    [
        ("loopvq", "half", 2, 16, 8, 1237, 0),
        ("loopvq", "half", 2, 8, 4, 1237, 2),
        ("loopvq", "interleaved", 6, 16, 4, 1101, 2),
        ("loopvq", "interleaved", 6, 8, 2, 1101, 0),
        ("tasq+loopvq", "half", 4, 16, 8, 999, 2),
    ],
)
def test_kernel_fp16_tables_over_many_anchors_per_warp(method, style, q_heads, lanes, tokens, n, pad):
    """The default fp16 path (Chebyshev query recurrence re-anchored every 4 warp steps, packed-half key and
    value sums) far past a warp's first anchor: one split and 2 warps, so each warp walks n/2 tokens, 8 or 16
    per step: 8 to 18 anchors per warp; GQA, interleaved RoPE, masked padding, a partial last step."""
    check(
        method,
        style,
        heads=2,
        q_heads=q_heads,
        n=n,
        s_fp=9,
        d=128,
        k=64,
        g=16,
        splits=1,
        pad=pad,
        seed=n,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        backend="cuda",
        warps=2,
        tokens_per_iteration=tokens,
        lanes_per_token=lanes,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_fp16_tables_with_large_biased_keys(lanes):
    """Keys with near-constant channels around 10, queries of scale 5 (q . k of a few hundred): fp16 tables and
    bf16 inputs alone give 6.4e-3 at the first step (the Triton kernel on the CPU, fp32 sums); the packed-half key
    dot product adds its own rounding, so the bound is 2e-2, not 1e-2."""
    check(
        "loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=700,
        s_fp=9,
        d=128,
        k=64,
        g=16,
        splits=1,
        pad=2,
        seed=5,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=2e-2,
        backend="cuda",
        warps=2,
        lanes_per_token=lanes,
        key_bias=10.0,
        q_scale=5.0,
    )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("lanes", [8, 16])
def test_kernel_fp16_keys_with_fp32_values(lanes):
    """Values of a few thousand: fp32 value table (fp32 value sums, angle addition instead of the recurrence)
    next to the fp16 key table's packed-half dot product."""
    check(
        "loopvq",
        "half",
        heads=2,
        q_heads=2,
        n=300,
        s_fp=9,
        d=128,
        k=64,
        g=16,
        splits=1,
        pad=2,
        seed=6,
        table_dtype=torch.float16,
        dtype=torch.bfloat16,
        tol=1e-2,
        backend="cuda",
        warps=2,
        lanes_per_token=lanes,
        value_scale=2000.0,
    )
