"""Decode attention with the coded count read on the device (``CodedTokens.live``, what a static cache under a CUDA
graph passes): launches planned for the capacity, the kernels attend over the first ``live`` coded tokens only.
Triton's interpreter on the CPU (in a child process: TRITON_INTERPRET=1 precedes the import of triton), Triton and
the CUDA kernel on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import run_kernel_script
from support.decode import make_codecs, make_inputs

from loopvq_calib.kernels.backends import triton
from loopvq_calib.serving import decode_attention as da

LIVE = r"""
import json, sys, torch
from loopvq_calib.codes.codec import BlockCodec, TasqTransform
from loopvq_calib.codes.layouts import BlockLayout, loop_axis_groups
from loopvq_calib.serving import decode_attention as da
device = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(0)
heads, d, k, size, steps, b, cap, n_fp = 2, 64, 16, 8, 4, 2, 40, 6

def codec(kind, tasq):
    lay = BlockLayout("b0.l0", kind, tuple(range(steps)), d, heads, loop_axis_groups(d, steps, size)[None])
    weight = TasqTransform(torch.rand(steps, heads, d, generator=g) + 0.5) if tasq else None
    return BlockCodec(lay, torch.randn(heads, lay.num_groups, k, size, generator=g), weight)

def head_major(n):
    idx = torch.randint(0, k, (b, cap, heads, n), generator=g).to(torch.uint8)
    return idx.transpose(1, 2).contiguous().transpose(1, 2)

out = {}
for style, tasq in (("half", True), ("interleaved", False)):
    kc, vc = codec("key", tasq), codec("value", False)
    ki, vi = head_major(kc.layout.num_groups), head_major(vc.layout.num_groups)
    sigma = (torch.rand(b, cap, steps, generator=g) + 0.5).half() if tasq else None
    first = torch.tensor([6, 9], dtype=torch.int32)
    q, fk, fv = (torch.randn(b, *shape, generator=g) for shape in ((heads, d), (n_fp, heads, d), (n_fp, heads, d)))
    fpos = torch.cat([torch.arange(3).expand(b, -1), first[:, None] + cap + torch.arange(3)], 1)
    mask = torch.ones(b, n_fp, dtype=torch.bool)
    mask[0, 4] = False
    tables = da.step_tables(kc, vc, 1, rope_style=style, device=device, dtype=torch.float32)
    fp = da.FullPrecisionTokens(fk.to(device), fv.to(device), fpos.to(device), mask.to(device))
    for live in (0, 13, cap):
        def reference(coded):
            return da.decode_attention_reference(q, kc, vc, step=1, coded=coded, fp_keys=fk, fp_values=fv,
                                                 fp_positions=fpos, fp_mask=mask, rope_style=style, rope_theta=1e4)
        want = reference(da.CodedTokens(ki, vi, sigma, live, first))
        count = torch.tensor([live], dtype=torch.int32)
        counted = reference(da.CodedTokens(ki, vi, sigma, cap, first, count))
        out[f"reference-{style}-{live}"] = torch.equal(counted, want)
        full = reference(da.CodedTokens(ki, vi, sigma, cap, first))
        out[f"full-{style}-{live}"] = ((full - want).norm() / want.norm()).item()
        coded = da.CodedTokens(ki.to(device), vi.to(device), None if sigma is None else sigma.to(device), cap,
                               first.to(device), count.to(device))
        for backend in ("triton", "cuda") if device.type == "cuda" else ("triton",):
            got = da.decode_attention(q.to(device), tables, coded, fp=fp, rope=da.RopeTable(d, 1e4), max_position=64,
                                      backend=backend, triton=da.TritonDecodeLaunch(block_n=8, num_splits=3),
                                      cuda=da.CudaDecodeLaunch(num_splits=3))
            out[f"{backend}-{style}-{live}"] = ((got.cpu().double() - want).norm() / want.norm()).item()
print(json.dumps(out))
"""


@pytest.mark.skipif(triton is None, reason="needs triton")
def test_the_kernels_attend_to_the_live_coded_tokens_only():
    """Capacity 40 planned in 3 splits, live 0, 13 (inside the first split) and 40, both RoPE styles, TaSQ keys
    (half) and LoopVQ keys (interleaved), a masked column: every kernel matches the reference of the live tokens
    (1e-5, fp32); the reference reads ``live`` itself; attending all 40 would differ wherever live < 40."""
    out = run_kernel_script(LIVE)
    for style in ("half", "interleaved"):
        for live in (0, 13, 40):
            assert out[f"reference-{style}-{live}"], (style, live)
            assert (out[f"full-{style}-{live}"] > 1e-2) == (live < 40), (style, live)
            for backend in ("triton", "cuda"):
                if f"{backend}-{style}-{live}" in out:
                    assert out[f"{backend}-{style}-{live}"] < 1e-5, (backend, style, live)
    assert ("cuda-half-13" in out) == torch.cuda.is_available()


def test_live_above_the_count_reads_the_count():
    """``live`` is clamped to ``count`` (the capacity): the reference decodes at most ``count`` tokens."""
    kc, vc = make_codecs("loopvq", 2, 16, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 2, 2, 5, 4, seed=3)
    args = dict(step=1, fp_keys=fk, fp_values=fv, fp_positions=fpos, fp_mask=None, rope_style="half", rope_theta=1e4)
    want = da.decode_attention_reference(q, kc, vc, coded=coded, **args)
    above = da.CodedTokens(
        coded.key_indices, coded.value_indices, None, 5, coded.first_position, torch.tensor([7], dtype=torch.int32)
    )
    assert torch.equal(da.decode_attention_reference(q, kc, vc, coded=above, **args), want)
