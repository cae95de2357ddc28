"""The Triton decode-attention kernels (the design: :mod:`~loopvq_calib.serving.decode_attention` and
docs/serving.md): a split-K attention pass over coded and full-precision tokens, where each program
gathers a head's step tables through the L1 cache (the CPU-interpreter path and the fallback of the CUDA kernel
in ``decode_attention.cu``), and a log-sum-exp merge of the splits. :func:`decode_attention_triton` launches
them with a :class:`TritonDecodeLaunch`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .backends import pow2, tl, triton
from .decode_inputs import CodedTokens, FullPrecisionTokens, KernelInputs, StepTables

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TritonDecodeLaunch:
    """How the Triton kernel is launched: ``block_n`` tokens per tile, ``num_warps`` per program; programs
    are (KV head, split, slice of ``batch_per_program`` sequences), about ``programs_per_sm`` per multiprocessor
    unless ``num_splits`` coded splits per KV head are given; ``cache_hints``: tables loaded evict-last and the
    index stream evict-first."""

    block_n: int = 16
    num_warps: int = 4
    programs_per_sm: int = 4
    batch_per_program: int = 1
    cache_hints: bool = False
    num_splits: int | None = None


DEFAULT_TRITON_LAUNCH = TritonDecodeLaunch()  # every setting at its default


if triton is not None:

    @triton.jit
    def _online_softmax(sc, v, m_i, l_i, acc):
        """Fold a tile's base-2 logits sc [QGP, N] and values v [N, DP] into the running (max, sum, acc)."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None], axis=1)
        return m_new, l_i, acc

    # counts that change between calls are not specialised on: no recompilation as the cache grows
    @triton.jit(do_not_specialize=["n_batch", "batch_per_program", "n_coded", "n_fp", "split_len"])
    def _split_kernel(
        q_ptr,
        kidx_ptr,
        vidx_ptr,
        sig_ptr,
        ka_ptr,
        kb_ptr,
        kca_ptr,
        kcb_ptr,
        kp_ptr,
        tv_ptr,
        vc_ptr,
        p0_ptr,
        live_ptr,
        cos_ptr,
        sin_ptr,
        fk_ptr,
        fv_ptr,
        fpos_ptr,
        fmask_ptr,
        acc_ptr,
        ml_ptr,
        n_batch,
        batch_per_program,
        n_coded,
        n_fp,
        split_len,
        qk_scale,
        s_kib,
        s_kit,
        s_kih,
        s_vib,
        s_vit,
        s_vih,
        s_sb,
        s_st,
        s_fkb,
        s_fkt,
        s_fkh,
        s_fvb,
        s_fvt,
        s_fvh,
        s_fpb,
        H: tl.constexpr,
        QG: tl.constexpr,
        QGP: tl.constexpr,
        D: tl.constexpr,
        K: tl.constexpr,
        HALF: tl.constexpr,
        PAIRS: tl.constexpr,
        TASQ: tl.constexpr,
        STEP: tl.constexpr,
        HAS_MASK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        DP: tl.constexpr,
        TABLE_EVICT: tl.constexpr = "",
        STREAM_EVICT: tl.constexpr = "",
        LIVE: tl.constexpr = False,
    ):
        # one program per (KV head, split, batch slice), looping over its sequences: the head's step tables
        # (the codebook slice, [K, D] per kind) stay hot in the multiprocessor's L1 cache across them
        h = tl.program_id(0)
        s = tl.program_id(1)
        b_first = tl.program_id(2) * batch_per_program
        b_last = tl.minimum(b_first + batch_per_program, n_batch)
        n_splits = tl.num_programs(1) - 1  # the last split takes the full-precision tokens
        D2: tl.constexpr = D // 2
        i = tl.arange(0, DP // 2)  # head dims that are no power of two (Huginn's 96) are padded to DP
        d = tl.arange(0, DP)
        i_ok = i < D2
        d_ok = d < D
        r = tl.arange(0, QGP)
        j = tl.arange(0, BLOCK_N)
        if PAIRS:  # slot i holds RoPE pair fr[i] (a channels layout's pairs in code order): its channels, cos/sin
            fr = tl.load(kp_ptr + h * D2 + i, mask=i_ok, other=0)
        else:
            fr = i
        if HALF:
            ca_ch = fr
            cb_ch = fr + D2
        else:
            ca_ch = 2 * fr
            cb_ch = 2 * fr + 1
        row_ok = r < QG
        q_ok = row_ok[:, None] & i_ok[None, :]
        code_a = tl.load(kca_ptr + h * D2 + i, mask=i_ok, other=0)
        code_b = tl.load(kcb_ptr + h * D2 + i, mask=i_ok, other=0)
        code_v = tl.load(vc_ptr + h * D + d, mask=d_ok, other=0)
        tab_a = ka_ptr + h.to(tl.int64) * K * D2
        tab_b = kb_ptr + h.to(tl.int64) * K * D2
        tab_v = tv_ptr + h.to(tl.int64) * K * D
        cos_d = tl.load(cos_ptr + j[:, None] * D2 + fr[None, :], mask=i_ok[None, :], other=0.0)  # by 0..BLOCK_N-1
        sin_d = tl.load(sin_ptr + j[:, None] * D2 + fr[None, :], mask=i_ok[None, :], other=0.0)
        if LIVE:  # the valid count read on the device (a static cache under a CUDA graph)
            n_coded = tl.minimum(tl.load(live_ptr), n_coded)
        start = s * split_len  # coded tokens [start, end) of this split (none for the last split)
        end = tl.where(s < n_splits, tl.minimum(start + split_len, n_coded), start)
        fend = tl.where(s == n_splits, n_fp, 0)

        for bi in range(b_first, b_last):
            b = tl.cast(bi, tl.int64)
            qrow = (b * H * QG + h * QG + r) * D
            qa = tl.load(q_ptr + qrow[:, None] + ca_ch[None, :], mask=q_ok, other=0.0).to(tl.float32) * qk_scale
            qb = tl.load(q_ptr + qrow[:, None] + cb_ch[None, :], mask=q_ok, other=0.0).to(tl.float32) * qk_scale
            m_i = tl.full([QGP], -1.0e30, tl.float32)
            l_i = tl.zeros([QGP], tl.float32)
            acc = tl.zeros([QGP, DP], tl.float32)
            p0 = tl.load(p0_ptr + b).to(tl.int64)
            for t0 in range(start, end, BLOCK_N):
                tok = t0 + j
                ok = tok < end
                base = p0 + t0
                cb = tl.load(cos_ptr + base * D2 + fr, mask=i_ok, other=0.0)
                sb = tl.load(sin_ptr + base * D2 + fr, mask=i_ok, other=0.0)
                qa2 = qa * cb[None, :] + qb * sb[None, :]  # the query rotated back by the tile's first position
                qb2 = qb * cb[None, :] - qa * sb[None, :]
                u = qa2[:, None, :] * cos_d[None] + qb2[:, None, :] * sin_d[None]  # [QGP, N, D/2]
                w = qb2[:, None, :] * cos_d[None] - qa2[:, None, :] * sin_d[None]
                krow = kidx_ptr + b * s_kib + tok.to(tl.int64)[:, None] * s_kit + h * s_kih
                t_ok = ok[:, None] & i_ok[None, :]
                ia = tl.load(krow + code_a[None, :], mask=t_ok, other=0, eviction_policy=STREAM_EVICT).to(tl.int32)
                ib = tl.load(krow + code_b[None, :], mask=t_ok, other=0, eviction_policy=STREAM_EVICT).to(tl.int32)
                ka = tl.load(tab_a + ia * D2 + i[None, :], mask=i_ok[None, :], other=0.0, eviction_policy=TABLE_EVICT)
                kb = tl.load(tab_b + ib * D2 + i[None, :], mask=i_ok[None, :], other=0.0, eviction_policy=TABLE_EVICT)
                ka = ka.to(tl.float32)
                kb = kb.to(tl.float32)
                if TASQ:
                    sg = tl.load(sig_ptr + b * s_sb + tok.to(tl.int64) * s_st + STEP, mask=ok, other=0.0).to(tl.float32)
                    ka = ka * sg[:, None]
                    kb = kb * sg[:, None]
                sc = tl.sum(ka[None] * u + kb[None] * w, axis=2)  # [QGP, N], base-2 logits
                sc = tl.where(ok[None, :], sc, float("-inf"))
                vrow = vidx_ptr + b * s_vib + tok.to(tl.int64)[:, None] * s_vit + h * s_vih
                iv = tl.load(
                    vrow + code_v[None, :], mask=ok[:, None] & d_ok[None, :], other=0, eviction_policy=STREAM_EVICT
                ).to(tl.int32)
                v = tl.load(tab_v + iv * D + d[None, :], mask=d_ok[None, :], other=0.0, eviction_policy=TABLE_EVICT)
                m_i, l_i, acc = _online_softmax(sc, v.to(tl.float32), m_i, l_i, acc)

            # full-precision tokens (sinks and window), pre-RoPE, each at its own position
            for t0 in range(0, fend, BLOCK_N):
                tok = t0 + j
                ok = tok < fend
                if HAS_MASK:
                    ok = ok & (tl.load(fmask_ptr + b * s_fpb + tok, mask=ok, other=0) != 0)
                pos = tl.load(fpos_ptr + b * s_fpb + tok, mask=tok < fend, other=0).to(tl.int64)
                c = tl.load(cos_ptr + pos[:, None] * D2 + fr[None, :], mask=i_ok[None, :], other=0.0)
                sn = tl.load(sin_ptr + pos[:, None] * D2 + fr[None, :], mask=i_ok[None, :], other=0.0)
                u = qa[:, None, :] * c[None] + qb[:, None, :] * sn[None]
                w = qb[:, None, :] * c[None] - qa[:, None, :] * sn[None]
                krow = fk_ptr + b * s_fkb + tok.to(tl.int64)[:, None] * s_fkt + h * s_fkh
                f_ok = (tok < fend)[:, None] & i_ok[None, :]
                ka = tl.load(krow + ca_ch[None, :], mask=f_ok, other=0.0).to(tl.float32)
                kb = tl.load(krow + cb_ch[None, :], mask=f_ok, other=0.0).to(tl.float32)
                sc = tl.sum(ka[None] * u + kb[None] * w, axis=2)
                sc = tl.where(ok[None, :], sc, float("-inf"))
                vrow = fv_ptr + b * s_fvb + tok.to(tl.int64)[:, None] * s_fvt + h * s_fvh
                v = tl.load(vrow + d[None, :], mask=(tok < fend)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                m_i, l_i, acc = _online_softmax(sc, v, m_i, l_i, acc)

            qh = (b * H * QG + h * QG + r) * (n_splits + 1) + s  # [B, Hq, splits + 1] rows
            tl.store(acc_ptr + qh[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
            tl.store(ml_ptr + qh * 2, m_i, mask=row_ok)
            tl.store(ml_ptr + qh * 2 + 1, l_i, mask=row_ok)

    @triton.jit
    def _merge_kernel(acc_ptr, ml_ptr, out_ptr, S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # one (sequence, query head)
        sp = tl.arange(0, SP)
        d = tl.arange(0, DP)
        ok = sp < S
        m = tl.load(ml_ptr + (row * S + sp) * 2, mask=ok, other=-1.0e30)
        l_s = tl.load(ml_ptr + (row * S + sp) * 2 + 1, mask=ok, other=0.0)
        scale = tl.exp2(m - tl.max(m, axis=0))
        acc = tl.load(
            acc_ptr + (row * S + sp[:, None]) * D + d[None, :], mask=ok[:, None] & (d < D)[None, :], other=0.0
        )
        out = tl.sum(acc * scale[:, None], axis=0) / tl.sum(l_s * scale, axis=0)
        tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def plan_splits(n_coded: int, heads: int, block_n: int, *, programs: int) -> tuple[int, int]:
    """(coded splits, tokens per split): at most ``programs`` programs over the KV heads (at least one split
    each), each split a whole number of ``block_n`` tiles; one (empty) split when nothing is coded."""
    tiles = -(-n_coded // block_n)
    if not tiles:
        return 1, block_n
    per_split = -(-tiles // max(1, min(tiles, programs // heads))) * block_n
    return -(-n_coded // per_split), per_split


def _multiprocessors(device: torch.device) -> int:
    """Multiprocessors on CUDA (programs are planned per multiprocessor); 0 elsewhere (the interpreter: one
    split per row unless asked)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0


def _splits(
    launch: TritonDecodeLaunch, n_coded: int, heads: int, *, slices: int, device: torch.device
) -> tuple[int, int]:
    """(coded splits, tokens per split) of a launch whose batch is cut in ``slices`` of ``batch_per_program`` rows:
    :func:`plan_splits` over ``num_splits`` programs per KV head when given, else over ``programs_per_sm`` per
    multiprocessor shared by the slices."""
    programs = (
        launch.num_splits * heads if launch.num_splits else _multiprocessors(device) * launch.programs_per_sm // slices
    )
    return plan_splits(n_coded, heads, launch.block_n, programs=programs)


def decode_attention_triton(
    inputs: KernelInputs, tables: StepTables, coded: CodedTokens, *, fp: FullPrecisionTokens, launch: TritonDecodeLaunch
) -> torch.Tensor:
    """Attention [B, Hq, D] in q's dtype of ``inputs.q`` over the coded and full-precision tokens (the RoPE table
    in ``inputs`` covers every position plus ``launch.block_n`` rows): the split kernel, then the merge."""
    q = inputs.q
    bsz, hq, d = q.shape
    heads, k = tables.value.shape[0], tables.value.shape[1]
    n, qg = coded.count, hq // heads
    slices = -(-bsz // launch.batch_per_program)
    splits, per_split = _splits(launch, n, heads, slices=slices, device=q.device)
    kidx, vidx, sig, fk, fv = coded.key_indices, coded.value_indices, inputs.sigma, fp.keys, fp.values
    acc = torch.empty(bsz, hq, splits + 1, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz, hq, splits + 1, 2, device=q.device, dtype=torch.float32)
    hints = launch.cache_hints
    pairs = tables.key_pairs
    _split_kernel[(heads, splits + 1, slices)](
        q,
        kidx,
        vidx,
        sig,
        tables.key_a,
        tables.key_b,
        tables.key_code_a,
        tables.key_code_b,
        tables.key_code_a if pairs is None else pairs,
        tables.value,
        tables.value_code,
        inputs.first,
        inputs.first if coded.live is None else coded.live,
        inputs.cos,
        inputs.sin,
        fk,
        fv,
        inputs.fp_positions,
        inputs.fp_mask,
        acc,
        ml,
        bsz,
        launch.batch_per_program,
        n,
        fk.shape[1],
        per_split,
        LOG2E / math.sqrt(d),
        kidx.stride(0),
        kidx.stride(1),
        kidx.stride(2),
        vidx.stride(0),
        vidx.stride(1),
        vidx.stride(2),
        sig.stride(0),
        sig.stride(1),
        fk.stride(0),
        fk.stride(1),
        fk.stride(2),
        fv.stride(0),
        fv.stride(1),
        fv.stride(2),
        inputs.fp_positions.stride(0),
        H=heads,
        QG=qg,
        QGP=pow2(qg),
        D=d,
        K=k,
        HALF=tables.rope_style == "half",
        PAIRS=pairs is not None,
        TASQ=tables.tasq,
        STEP=tables.step,
        HAS_MASK=inputs.masked,
        BLOCK_N=launch.block_n,
        DP=pow2(d),
        TABLE_EVICT="evict_last" if hints else "",
        STREAM_EVICT="evict_first" if hints else "",
        LIVE=coded.live is not None,
        num_warps=launch.num_warps,
    )
    return merged(acc, ml, q.dtype)


def merged(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Log-sum-exp merge of the splits: acc [B, Hq, S, D], ml [B, Hq, S, 2] (max, sum) -> [B, Hq, D]."""
    bsz, hq, splits, d = acc.shape
    out = torch.empty(bsz, hq, d, device=acc.device, dtype=dtype)
    _merge_kernel[(bsz * hq,)](acc, ml, out, S=splits, SP=pow2(splits), D=d, DP=pow2(d), num_warps=4)
    return out
