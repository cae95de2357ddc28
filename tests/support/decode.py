"""Tiny decode-attention cases: codecs, coded inputs, the reference check, and a CPU emulation of the CUDA
kernel's lane reads; shared by the serving and kernel tests."""

from __future__ import annotations

import math

import torch
from conftest import KERNEL_DEVICE as DEVICE

from loopvq_calib.codes.codec import BlockCodec, TasqTransform
from loopvq_calib.codes.layouts import BlockLayout, channel_groups, loop_axis_groups
from loopvq_calib.kernels import decode_lanes as dl
from loopvq_calib.models.common import pair_channels, rope_angles
from loopvq_calib.serving import decode_attention as da
from loopvq_calib.serving.cache import QuantizedLoopKVCache


def permuted_groups(heads: int, steps: int, d: int, g: int, seed: int) -> torch.Tensor:
    """A TaSQ-like per-head layout: any permutation of the flat coordinates (the kernel must not assume pairs)."""
    return torch.stack([torch.randperm(steps * d, generator=gen(seed + h)) for h in range(heads)]).view(heads, -1, g)


def channels_groups(heads: int, steps: int, d: int, g: int, style: str, seed: int) -> torch.Tensor:
    """A TaSQ channels layout per head (``tasq.grouping: channels``): random RoPE pairs of ``style``, G / steps / 2
    per code, each at every step; coordinates sorted, codes by their first coordinate (as the TaSQ stage writes)."""
    a, b = pair_channels(d, style)
    out = []
    for h in range(heads):
        perm = torch.randperm(d // 2, generator=gen(seed + h)).view(-1, g // steps // 2)  # the pairs of each code
        channels = torch.cat([a[perm], b[perm]], 1)
        coords = (torch.arange(steps)[None, :, None] * d + channels[:, None, :]).flatten(1).sort(-1).values
        out.append(coords[coords[:, 0].argsort()])
    return torch.stack(out)


def lane_reads(idx: torch.Tensor, table: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """What every lane reads per token, at the kernel's offsets: idx [B, n, H, codes], table [H, runs, K, L,
    run] read flat at (r * K * L + lane) * run + index * L * run + i, column [H, L, runs] -> [B, n, H, L,
    runs * run] float64 in run-major order."""
    heads, runs, k, lanes, run = table.shape
    b, n = idx.shape[:2]
    flat = table.double().reshape(heads, -1)
    ix = (
        idx.long().gather(3, column.long().reshape(1, 1, heads, -1).expand(b, n, -1, -1)).view(b, n, heads, lanes, runs)
    )
    r, lane, i = torch.arange(runs), torch.arange(lanes), torch.arange(run)
    offset = ((r[None, :, None] * k * lanes + lane[:, None, None]) * run + i) + ix[..., None] * lanes * run
    return flat[torch.arange(heads)[None, None, :, None], offset.reshape(b, n, heads, -1)].view(b, n, heads, lanes, -1)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_codecs(
    method: str,
    heads: int,
    d: int,
    k: int,
    g: int,
    steps: int,
    sharing: str = "none",
    seed: int = 0,
    *,
    grouping: str = "free",
    style: str = "half",
):
    """Key and value codecs of one block with the layouts of ``method`` (T_b = ``steps`` for loop-axis methods);
    TaSQ keys: any permutation (``grouping`` free) or :func:`channels_groups` of RoPE ``style``."""
    loop = method in ("loopvq", "tasq+loopvq")
    t_b = steps if loop else 1
    plain = loop_axis_groups(d, t_b, g)[None] if loop else channel_groups(d, g)[None]
    key_groups = permuted_groups(heads, t_b, d, g, seed) if method.startswith("tasq") else plain
    if grouping == "channels":
        key_groups = channels_groups(heads, t_b, d, g, style, seed)

    def codec(kind: str, groups: torch.Tensor, tasq: bool, s: int) -> BlockCodec:
        lay = BlockLayout("b0.l0", kind, tuple(range(t_b)), d, heads, groups.clone())
        hc = 1 if sharing in ("heads", "all") else heads
        nc = 1 if sharing in ("groups", "all") else groups.shape[1]
        cb = torch.randn(hc, nc, k, g, generator=gen(s))
        weight = torch.rand(t_b, heads, d, generator=gen(s + 1)) + 0.5 if tasq else None
        return BlockCodec(lay, cb, TasqTransform(weight) if tasq else None)

    return codec("key", key_groups, method.startswith("tasq"), seed + 10), codec("value", plain, False, seed + 20)


def make_inputs(
    kc: BlockCodec,
    vc: BlockCodec,
    batch: int,
    q_heads: int,
    n: int,
    s_fp: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    pad: int = 0,
):
    """Random coded tokens (with spare capacity past ``n``), query and full-precision tokens; row 0 has ``pad``
    masked (left-padding) tokens at position 0 in its full-precision part."""
    heads, d, k = kc.layout.kv_heads, kc.layout.head_dim, kc.codebook.shape[2]
    idt = torch.uint8 if k <= 256 else torch.int32
    cap = n + 3
    first = torch.randint(s_fp, 3 * s_fp + 2, (batch,), generator=gen(seed))
    sigma = (torch.rand(batch, cap, kc.layout.steps, generator=gen(seed + 1)) + 0.5).half() if kc.transform else None
    coded = da.CodedTokens(
        torch.randint(0, k, (batch, cap, heads, kc.layout.num_groups), generator=gen(seed + 2)).to(idt),
        torch.randint(0, k, (batch, cap, heads, vc.layout.num_groups), generator=gen(seed + 3)).to(idt),
        sigma,
        n,
        first,
    )
    q = torch.randn(batch, q_heads, d, generator=gen(seed + 4)).to(dtype)
    fk = torch.randn(batch, s_fp, heads, d, generator=gen(seed + 5)).to(dtype)
    fv = torch.randn(batch, s_fp, heads, d, generator=gen(seed + 6)).to(dtype)
    fpos = torch.arange(s_fp)[None].repeat(batch, 1)
    fpos[:, s_fp // 2 :] += (first + n - s_fp // 2)[:, None]  # window tokens after the coded ones
    mask = torch.ones(batch, s_fp, dtype=torch.bool)
    mask[0, :pad] = False
    fpos[0, :pad] = 0
    fpos[0, pad : s_fp // 2] = torch.arange(s_fp // 2 - pad)
    return coded, q, fk, fv, fpos, (mask if pad else None)


def head_major(idx: torch.Tensor) -> torch.Tensor:
    """The same [B, N, H, n] indices stored head-major ([B, H, N, n] memory), as the cache's code buffers are."""
    return idx.transpose(1, 2).contiguous().transpose(1, 2)


def check(
    method: str,
    style: str,
    heads: int,
    q_heads: int,
    n: int,
    s_fp: int,
    *,
    steps: int = 4,
    d: int = 16,
    k: int = 16,
    g: int = 8,
    sharing: str = "none",
    block_n: int = 8,
    splits: int | None = None,
    pad: int = 0,
    seed: int = 0,
    table_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype = torch.float32,
    tol: float = 1e-5,
    batch: int = 2,
    per_program: int = 1,
    hints: bool = False,
    key_bias: float = 0.0,
    q_scale: float = 1.0,
    value_scale: float = 1.0,
    backend: str = "auto",
    grouping: str = "free",
    **cuda,
) -> None:
    """Kernel output against the reference at every step; ``key_bias`` is added to every key (codewords and
    full-precision keys: near-constant channels of that magnitude), the query is multiplied by ``q_scale`` and
    every value (codewords and full-precision values) by ``value_scale``. ``block_n``, ``per_program`` and
    ``hints`` launch the Triton kernel, ``cuda`` (CudaDecodeLaunch's fields) the CUDA kernel; ``splits`` both;
    ``grouping``: TaSQ keys' layout (make_codecs)."""
    kc, vc = make_codecs(method, heads, d, k, g, steps, sharing, seed, grouping=grouping, style=style)
    coded, q, fk, fv, fpos, mask = make_inputs(kc, vc, batch, q_heads, n, s_fp, seed, dtype, pad)
    if key_bias or q_scale != 1.0 or value_scale != 1.0:
        q, fk, fv = scale_inputs(
            kc, vc, q, fk, fv, key_bias=key_bias, q_scale=q_scale, value_scale=value_scale, dtype=dtype
        )
    rope = da.RopeTable(d, 10000.0)
    for step in range(kc.layout.steps):
        tables = da.step_tables(kc, vc, step, rope_style=style, device=DEVICE, dtype=table_dtype)
        dev = [t.to(DEVICE) if t is not None else None for t in (q, fk, fv, fpos, mask)]
        triton = da.TritonDecodeLaunch(
            block_n=block_n, num_splits=splits, batch_per_program=per_program, cache_hints=hints
        )
        out = da.decode_attention(
            dev[0],
            tables,
            device_tokens(coded, backend),
            fp=da.FullPrecisionTokens(*dev[1:]),
            rope=rope,
            backend=backend,
            triton=triton,
            cuda=da.CudaDecodeLaunch(num_splits=splits, **cuda),
        )
        ref = da.decode_attention_reference(
            q.float(),
            kc,
            vc,
            step=step,
            coded=coded,
            fp_keys=fk,
            fp_values=fv,
            fp_positions=fpos,
            fp_mask=mask,
            rope_style=style,
            rope_theta=10000.0,
        )
        assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < tol, (method, style, step, err)


def scale_inputs(
    kc: BlockCodec,
    vc: BlockCodec,
    q: torch.Tensor,
    fk: torch.Tensor,
    fv: torch.Tensor,
    *,
    key_bias: float,
    q_scale: float,
    value_scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``key_bias`` added to every key (the key codewords, in place, and the full-precision keys), the query
    multiplied by ``q_scale`` and every value (the value codewords, in place, and the full-precision values) by
    ``value_scale``: the query and full-precision keys and values, in ``dtype``."""
    kc.codebook.data += key_bias
    vc.codebook.data *= value_scale
    fk, q = (fk.float() + key_bias).to(dtype), (q.float() * q_scale).to(dtype)
    fv = (fv.float() * value_scale).to(dtype)
    return q, fk, fv


def device_tokens(coded: da.CodedTokens, backend: str) -> da.CodedTokens:
    """``coded`` on the kernels' device; for the CUDA kernel its indices stored head-major, as the cache stores
    them."""
    store = head_major if backend == "cuda" else (lambda t: t)
    return da.CodedTokens(
        store(coded.key_indices).to(DEVICE),
        store(coded.value_indices).to(DEVICE),
        coded.key_sigma.to(DEVICE) if coded.key_sigma is not None else None,
        coded.count,
        coded.first_position,
    )


def dispatch_case():
    """A small CUDA-kernel-shaped call (uint8 head-major indices, fp32 tables) and its reference output."""
    kc, vc = make_codecs("loopvq", 2, 64, 16, 8, 4)
    coded, q, fk, fv, fpos, mask = make_inputs(kc, vc, 2, 2, 21, 5, seed=1, pad=1)
    coded = da.CodedTokens(
        head_major(coded.key_indices.to(torch.uint8)),
        head_major(coded.value_indices.to(torch.uint8)),
        None,
        coded.count,
        coded.first_position,
    )
    tables = da.step_tables(kc, vc, 2, rope_style="half", device="cpu", dtype=torch.float32)
    ref = da.decode_attention_reference(
        q,
        kc,
        vc,
        step=2,
        coded=coded,
        fp_keys=fk,
        fp_values=fv,
        fp_positions=fpos,
        fp_mask=mask,
        rope_style="half",
        rope_theta=1e4,
    )
    return tables, coded, q, fk, fv, fpos, mask, ref


def emulate(
    q: torch.Tensor, tables: da.StepTables, coded: da.CodedTokens, fk, fv, fpos, mask, theta: float, lane_count: int
):
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
    first = kch.view(heads, L, 2, pairs)[:, :, 0]  # the first channel of each lane's pairs -> the pair's angle
    pair = first % (d // 2) if tables.rope_style == "half" else first // 2
    cos, sin = (t.double()[:, :, pair][:, :, :, None] for t in rope_angles(pos, d, theta))  # [B, S, H, 1, L, pairs]
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


def prefill(
    model, prompt: torch.Tensor, quantizer, *, mask: torch.Tensor | None = None, backend: str = "torch", **serving
):
    """A QuantizedLoopKVCache after ``prompt``'s prefill (left padding in ``mask``) and the prefill's greedy token
    [B, 1]."""
    cache = QuantizedLoopKVCache(quantizer, backend=backend, **serving)
    kw = {} if mask is None else {"attention_mask": mask}
    with torch.inference_mode():
        out = model(prompt, cache=cache, use_cache=True, **kw)
    return cache, out.logits[:, -1:].argmax(-1)


def lockstep(model, eager, decoder, *, ids: torch.Tensor, steps: int, mask: torch.Tensor | None = None):
    """``steps`` decode steps of an eager cache (explicit forwards, the padding mask extended each step) and of a
    GraphDecoder, both fed the eager path's greedy tokens: yields (eager logits, decoder logits, eager regions,
    decoder's cache regions) per step."""
    with torch.inference_mode():
        for _ in range(steps):
            kw = {}
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
                kw["attention_mask"] = mask
            want = model(ids, cache=eager, use_cache=True, **kw).logits[:, -1]
            got = decoder.step(ids).clone()
            yield want, got, eager.regions(), decoder.cache.regions()
            ids = want.argmax(-1, keepdim=True)
