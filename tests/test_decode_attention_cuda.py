"""The shared-memory CUDA decode kernel (loopvq_calib/decode_cuda.py + decode_attention.cu).

On CPU: the slot tables the kernel reads are checked by an independent float64 emulation of the kernel's
arithmetic in slot order (each slot's code, run, RoPE partner, frequency and sign) against the reference
attention, for every method, both RoPE styles and GQA; the run lengths of known layouts; the calls the
kernel refuses. On a GPU (``gpu``): the kernel itself against the reference (tolerances as in
test_decode_attention.py: 1e-5 with float32 tables and inputs, 1e-2 with float16 tables and bf16 inputs)."""

from __future__ import annotations

import math

import pytest
import torch

from loopvq_calib import decode_attention as da
from loopvq_calib import decode_cuda as dc
from loopvq_calib.models.common import rope_angles
from test_decode_attention import check, make_codecs, make_inputs

CUDA = torch.cuda.is_available()


def emulate(q: torch.Tensor, tables: da.StepTables, coded: da.CodedTokens, fk, fv, fpos, mask, theta: float):
    """The kernel's arithmetic in slot order, float64: keys decoded per slot, the query rotated per slot
    (x = q_self cos + sign q_partner sin), values accumulated per slot and scattered to their channels."""
    slots = dc.slot_tables(tables)
    bsz, hq, d = q.shape
    heads, n = slots.key.shape[0], coded.count
    qg = hq // heads
    hh, ss = torch.arange(heads)[:, None], torch.arange(d)[None, :]
    q4 = q.double().view(bsz, heads, qg, d)
    qs = q4.gather(3, slots.key_channel.long()[None, :, None, :].expand(bsz, -1, qg, -1))
    qp = q4.gather(3, slots.key_partner.long()[None, :, None, :].expand(bsz, -1, qg, -1))
    sign = slots.key_sign.double()

    def phi(pos: torch.Tensor) -> torch.Tensor:  # pos [B, S] -> [B, S, H, qg, D]
        cos, sin = (t.double()[..., slots.key_freq.long()] for t in rope_angles(pos, d, theta))
        return qs[:, None] * cos[:, :, :, None] + qp[:, None] * (sign * sin)[:, :, :, None]

    def per_slot(idx: torch.Tensor, table: torch.Tensor, code: torch.Tensor, run: int) -> torch.Tensor:
        col = code.long().repeat_interleave(run, 1)  # [H, D] index column of every slot
        ix = idx[:, :n].long().gather(3, col[None, None].expand(bsz, n, -1, -1))
        return table.double()[hh, ix, ss]  # [B, n, H, D]

    kc = per_slot(coded.key_indices, slots.key, slots.key_code, slots.run_key)
    if tables.tasq and n:
        kc = kc * coded.key_sigma[:, :n, tables.step].double()[:, :, None, None]
    vc = per_slot(coded.value_indices, slots.value, slots.value_code, slots.run_value)
    kf = fk.double().gather(3, slots.key_channel.long()[None, None].expand(bsz, fk.shape[1], -1, -1))
    vf = fv.double().gather(3, slots.value_channel.long()[None, None].expand(bsz, fv.shape[1], -1, -1))
    pos = coded.first_position[:, None].long() + torch.arange(n)
    keys, values = torch.cat([kc, kf], 1), torch.cat([vc, vf], 1)
    scores = (keys[:, :, :, None] * torch.cat([phi(pos), phi(fpos)], 1)).sum(-1) / math.sqrt(d)  # [B, S, H, qg]
    if mask is not None:
        keep = torch.cat([torch.ones(bsz, n, dtype=torch.bool), mask], 1)
        scores = scores.masked_fill(~keep[:, :, None, None], float("-inf"))
    out_slot = torch.einsum("bshg,bshd->bhgd", scores.softmax(1), values)
    out = torch.empty_like(out_slot)
    out.scatter_(3, slots.value_channel.long()[None, :, None, :].expand(bsz, -1, qg, -1), out_slot)
    return out.reshape(bsz, hq, d)


@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("q_heads", [2, 6])
def test_slot_tables_give_the_reference_attention(method, style, q_heads):
    kc, vc = make_codecs(method, 2, 64, 16, 8, 4, seed=4)
    coded, q, fk, fv, fpos, mask = make_inputs(kc, vc, 2, q_heads, 23, 6, seed=4, pad=2)
    for step in range(kc.layout.steps):
        tables = da.step_tables(kc, vc, step, style, "cpu", torch.float32)
        got = emulate(q, tables, coded, fk, fv, fpos, mask, 1e4)
        ref = da.decode_attention_reference(q, kc, vc, step, coded, fk, fv, fpos, mask, style, 1e4)
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6, (method, style, step)  # float32 tables and angles


def test_run_lengths_of_known_layouts():
    """Loop-axis codes hold c = G / T_c consecutive channels of a step: runs of min(c, D/32) slots; a code that
    holds one channel per step (G = T_c) gives runs of 1; the table in slot order keeps every value."""
    for g, steps, run in ((16, 4, 4), (8, 4, 2), (4, 4, 1), (32, 4, 4)):
        kc, vc = make_codecs("loopvq", 2, 128, 16, g, steps)
        tables = da.step_tables(kc, vc, 1, "half", "cpu", torch.float32)
        slots = dc.slot_tables(tables)
        assert (slots.run_key, slots.run_value) == (run, run), g
        assert slots.key_code.shape == (2, 128 // run)
        key = torch.empty_like(slots.key)
        key.scatter_(2, slots.key_channel.long()[:, None, :].expand_as(key), slots.key)
        assert torch.equal(key[:, :, :64], tables.key_a) and torch.equal(key[:, :, 64:], tables.key_b)


def test_head_dims_that_are_no_multiple_of_32_are_left_to_triton():
    kc, vc = make_codecs("loopvq", 2, 24, 16, 8, 4)
    assert dc.slot_tables(da.step_tables(kc, vc, 0, "half", "cpu", torch.float32)) is None


def test_a_failed_build_is_remembered_and_named(monkeypatch):
    """A failed NVRTC build raises BuildError naming the kernel and its constants, is kept in BUILD_FAILED (so
    later calls go to Triton without compiling again), and backend='cuda' then says so."""
    def broken(*args, **kwargs):
        raise RuntimeError("nvrtc: error: broken on purpose")

    monkeypatch.setattr(dc, "BUILD_FAILED", [])
    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    with pytest.raises(dc.BuildError, match="broken on purpose") as err:
        dc._compiled((("D", 64), ("STEP", 3)), 0, 0)
    assert dc.KERNEL in str(err.value) and "'STEP': 3" in str(err.value) and dc.BUILD_FAILED == [err.value]
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    tables = da.step_tables(kc, vc, 0, "half", "cpu", torch.float16)
    with pytest.raises(RuntimeError, match="an earlier build failed: .*broken on purpose"):
        da.decode_attention(q, tables, coded, fk, fv, fpos, None, da.RopeTable(64, 1e4), backend="cuda")


def test_fits_checks_what_the_kernel_reads(monkeypatch):
    """The CUDA path is taken only when the kernel can read every tensor as it assumes: one-byte key AND value
    indices, fp16 TaSQ sigmas, unit inner strides (checked here with a stand-in CUDA query on the CPU)."""
    from types import SimpleNamespace

    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    slots = dc.slot_tables(da.step_tables(kc, vc, 0, "half", "cpu", torch.float16))
    monkeypatch.setattr(dc, "BUILD_FAILED", [])
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(shared_memory_per_block_optin=228 * 1024))
    cuda_q = SimpleNamespace(device=SimpleNamespace(type="cuda"), dtype=fk.dtype, shape=q.shape)
    u8 = SimpleNamespace(key_indices=coded.key_indices.to(torch.uint8), value_indices=coded.value_indices.to(torch.uint8),
                         key_sigma=None, count=coded.count)
    assert dc.fits(slots, cuda_q, fk, fv, u8, 8)
    assert not dc.fits(slots, cuda_q, fk, fv, SimpleNamespace(**{**vars(u8), "value_indices": u8.value_indices.int()}), 8)
    assert not dc.fits(slots, cuda_q, fk, fv, SimpleNamespace(**{**vars(u8), "key_sigma": torch.ones(1, 8, 4)}), 8)
    assert not dc.fits(slots, cuda_q, fk.transpose(-1, -2), fv, u8, 8)
    dc.BUILD_FAILED.append(dc.BuildError("earlier"))
    assert not dc.fits(slots, cuda_q, fk, fv, u8, 8)


def test_cpu_tensors_never_take_the_cuda_kernel():
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, _ = make_inputs(kc, vc, 1, 2, 5, 3, seed=0)
    slots = dc.slot_tables(da.step_tables(kc, vc, 0, "half", "cpu", torch.float16))
    assert not dc.fits(slots, q, fk, fv, coded, 8)
    tables = da.step_tables(kc, vc, 0, "half", "cpu", torch.float16)
    with pytest.raises(RuntimeError, match="CUDA decode kernel does not take this call"):
        da.decode_attention(q, tables, coded, fk, fv, fpos, None, da.RopeTable(64, 1e4), backend="cuda")
    with pytest.raises(ValueError, match="backend 'fast'"):
        da.decode_attention(q, tables, coded, fk, fv, fpos, None, da.RopeTable(64, 1e4), backend="fast")


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["cq", "tasq", "loopvq", "tasq+loopvq"])
@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_kernel_every_method_and_rope_style(method, style):
    check(method, style, heads=2, q_heads=2, n=77, s_fp=6, d=64, k=32, g=8, splits=3, pad=2, backend="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n, s_fp, splits, tokens, warps", [
    (0, 1, None, 16, 8), (1, 3, None, 16, 8), (15, 4, 2, 8, 4), (16, 20, 1, 16, 8), (129, 2, 3, 32, 8),
    (300, 12, 5, 4, 20), (1000, 9, None, 8, 16), (77, 5, 2, 16, 12),
])
def test_kernel_tile_split_and_region_boundaries(n, s_fp, splits, tokens, warps):
    check("loopvq", "half", heads=2, q_heads=2, n=n, s_fp=s_fp, d=128, k=64, g=16, splits=splits, seed=n,
          backend="cuda", tokens_per_iteration=tokens, warps=warps)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method, style, d", [("loopvq", "half", 96), ("tasq+loopvq", "interleaved", 64)])
def test_kernel_gqa_and_huginn_head_dim(method, style, d):
    check(method, style, heads=2, q_heads=6, n=50, s_fp=5, d=d, k=32, g=8, splits=2, seed=3, backend="cuda")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("method", ["loopvq", "tasq+loopvq"])
def test_kernel_at_ouro_shapes_in_fp16_tables_and_bf16(method):
    check(method, "half", heads=16, q_heads=16, n=3000, s_fp=72, d=128, k=256, g=16, table_dtype=torch.float16,
          dtype=torch.bfloat16, tol=1e-2, backend="cuda")
