"""Decode attention straight from coded pages: one query token per sequence, the kernels and their reference.

At a KV site (loop step ``step`` of a block) a sequence's cache is: coded tokens (a block's indices, shared by
all its steps, plus TaSQ's fp16 sigma per step) and full-precision pre-RoPE sink/window tokens.
:func:`decode_attention` attends a query to both without writing decoded keys or values anywhere:

- **Step tables** (:func:`step_tables`, built once per site, weights-like): for every KV head, the step's
  codeword values per *channel*, ``[H, K, D]``, gathered from the codebook through the block's group layout
  and divided by TaSQ's channel weight; plus, per channel, the code (index column) that holds it. Any layout
  (loop-axis, channel, TaSQ's permuted groups) decodes the same way: channel d of a token is
  ``table[h, idx[token, h, code[h, d]], d]`` (times sigma for TaSQ keys).
- **RoPE on the query side.** Keys are decoded pre-RoPE and never rotated: for a RoPE pair (a, b) at angle
  theta, ``q . R(theta) k = k_a (q_a cos + q_b sin) + k_b (q_b cos - q_a sin)``. Encoded tokens of a row sit at
  consecutive positions (left padding lives in the sink columns), so a tile of ``BLOCK_N`` tokens starting
  at position p rotates the query once by p (one row of the cos/sin table) and its tokens by 0..BLOCK_N-1 (the
  table's first rows, held in registers for the whole loop): angle addition instead of one table row per
  token and head. Full-precision tokens read their own row of the table.
- **Split-K**: program (sequence, KV head, split) runs an online softmax (base 2) over its token range and
  writes (max, sum, accumulator); the last split of each row takes the full-precision tokens. A second
  kernel merges the splits by log-sum-exp (the CUDA kernel merges them itself: the split that finishes last).
  GQA: a program serves the KV head's ``Hq / H`` query heads.

Two implementations: on CUDA, where the site fits it, the CUDA kernel of :mod:`~loopvq_calib.kernels.decode_cuda`
keeps a head's step tables in shared memory and reads one vector per run of a code (tables in lane order,
a lane group per token, the query rotated by a recurrence); the
Triton kernel of :mod:`~loopvq_calib.kernels.decode_triton` reads the tables through the L1 cache, one gather per
channel, and serves every other call. The Triton kernels need CUDA compute capability 8.0+ or Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors), like ``kmeans_triton``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

from ..codes.codec import BlockCodec, Codes
from ..kernels.kmeans import _pow2, available
from ..models.common import apply_rope, pair_channels, rope_angles

LOG2E = 1.4426950408889634
BACKENDS = ("auto", "cuda", "triton")
VALUE_TERMS = 16  # tokens the CUDA kernel sums per lane in one packed half (tokens per lane group and step, <= 16)
KEY_TERMS = 8  # products per packed half of the CUDA kernel's key dot product (8 lanes per token: 16 channels)
QUERY_BOUND = 32.0  # assumed bound of a scaled query channel |q| log2(e) / sqrt(D): |q| up to ~250 at D = 128


@dataclass
class StepTables:
    """What the kernel reads at one site: codeword values per channel and the code of each channel.

    ``key_a`` / ``key_b`` [H, K, D/2]: the first / second channel of every RoPE pair (``half``: i and i + D/2;
    ``interleaved``: 2i and 2i+1), divided by TaSQ's weight; ``key_code_a`` / ``key_code_b`` [H, D/2] int32;
    ``value`` [H, K, D], ``value_code`` [H, D] int32 (key and value tables may differ in dtype); ``tasq``:
    keys are multiplied by the token's sigma; ``rope_style`` the pairs' convention.
    """

    key_a: torch.Tensor
    key_b: torch.Tensor
    key_code_a: torch.Tensor
    key_code_b: torch.Tensor
    value: torch.Tensor
    value_code: torch.Tensor
    step: int
    tasq: bool
    rope_style: str
    lanes: dict = field(default_factory=dict, repr=False)  # lanes per token -> decode_cuda.LaneTables or None


def channel_codes(codec: BlockCodec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For step ``step`` of the block: the code and the position inside the codeword of every channel, [H, D] each."""
    lay = codec.layout
    d, g = lay.head_dim, lay.group_size
    flat = lay.groups.detach().cpu().reshape(lay.groups.shape[0], -1)  # entry e = code * G + position
    code = torch.empty(flat.shape[0], d, dtype=torch.long)
    pos = torch.empty(flat.shape[0], d, dtype=torch.long)
    for hg in range(flat.shape[0]):
        entries = ((flat[hg] // d) == step).nonzero().squeeze(1)
        channels = flat[hg, entries] % d
        if entries.numel() != d or torch.unique(channels).numel() != d:
            raise ValueError(f"layout {lay.key}: step {step} does not cover the {d} channels exactly once")
        code[hg, channels] = entries // g
        pos[hg, channels] = entries % g
    return code.expand(lay.kv_heads, -1), pos.expand(lay.kv_heads, -1)


def channel_table(codec: BlockCodec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's codeword value of every channel, [H, K, D] float32 (divided by TaSQ's weight), and the codes [H, D]."""
    code, pos = channel_codes(codec, step)
    cb = codec.codebook.detach().float().cpu()  # [Hc, nc, K, G]
    heads = codec.layout.kv_heads
    hc = torch.arange(heads) if cb.shape[0] == heads else torch.zeros(heads, dtype=torch.long)
    gc = code if cb.shape[1] == codec.layout.num_groups else torch.zeros_like(code)
    table = cb[hc[:, None], gc, :, pos].permute(0, 2, 1)  # [H, D, K] -> [H, K, D]
    if codec.transform is not None:
        table = table / codec.transform.weight.detach().float().cpu()[step][:, None, :]
    return table.contiguous(), code


def step_tables(key_codec: BlockCodec, value_codec: BlockCodec, step: int, *, rope_style: str,
                device: torch.device | str, dtype: torch.dtype = torch.float16) -> StepTables:
    """Build a site's :class:`StepTables` on ``device``; codeword values in ``dtype``, the key or the value
    tables in float32 where the CUDA kernel's half sums could overflow (:func:`table_dtype`)."""
    kt, kc = channel_table(key_codec, step)
    vt, vc = channel_table(value_codec, step)
    a, b = pair_channels(key_codec.layout.head_dim, rope_style)
    key_dtype = table_dtype(kt.abs().max().item(), dtype, "key")
    value_dtype = table_dtype(vt.abs().max().item(), dtype, "value")

    def put(t: torch.Tensor, as_dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=as_dtype).contiguous()

    i32 = torch.int32
    return StepTables(put(kt[:, :, a], key_dtype), put(kt[:, :, b], key_dtype), put(kc[:, a], i32), put(kc[:, b], i32),
                      put(vt, value_dtype), put(vc, i32), step, key_codec.transform is not None, rope_style)


def table_dtype(largest: float, dtype: torch.dtype, kind: str) -> torch.dtype:
    """``dtype`` for a ``kind`` ("key" / "value") table whose largest magnitude is ``largest``, or float32 where
    the CUDA kernel's packed-half sums could overflow ``dtype``: a value sum takes :data:`VALUE_TERMS` tokens
    with softmax weights <= 1; a key dot product :data:`KEY_TERMS` products with a scaled query channel up to
    :data:`QUERY_BOUND`."""
    if dtype == torch.float32:
        return dtype
    terms = VALUE_TERMS if kind == "value" else KEY_TERMS * QUERY_BOUND
    return torch.float32 if largest * terms > torch.finfo(dtype).max else dtype


class RopeTable:
    """cos / sin of ``position * inv_freq`` [P, D/2] float32 on one device, the model's arithmetic
    (:func:`~loopvq_calib.models.common.rope_angles`), grown to a power of two on demand."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def covering(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables of at least ``positions`` rows on ``device``."""
        if self.cos is None or self.cos.shape[0] < positions or self.cos.device != device:
            n = _pow2(max(positions, 64))
            cos, sin = rope_angles(torch.arange(n, device=device)[None], self.head_dim, self.theta)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos, self.sin


@dataclass
class CodedTokens:
    """One block's coded tokens of a batch: ``key_indices`` [B, >=N, H, nk], ``value_indices`` [B, >=N, H, nv]
    (uint8 or int32), ``key_sigma`` [B, >=N, T_b] float16 (TaSQ) or None, ``count`` N valid tokens, and
    ``first_position`` [B] the position of each row's first coded token (the others follow one by one)."""

    key_indices: torch.Tensor
    value_indices: torch.Tensor
    key_sigma: torch.Tensor | None
    count: int
    first_position: torch.Tensor


def decode_attention_reference(
    q: torch.Tensor, key_codec: BlockCodec, value_codec: BlockCodec, *, step: int, coded: CodedTokens,
    fp_keys: torch.Tensor, fp_values: torch.Tensor, fp_positions: torch.Tensor, fp_mask: torch.Tensor | None,
    rope_style: str, rope_theta: float,
) -> torch.Tensor:
    """The same attention in plain PyTorch (float64 after decoding): codecs decode the coded tokens, RoPE
    rotates keys at their positions, softmax over coded then full-precision tokens. q [B, Hq, D] post-RoPE;
    fp_keys / fp_values [B, S, H, D] pre-RoPE; fp_positions [B, S]; fp_mask [B, S] bool (True = attend) or
    None. Returns [B, Hq, D] float64."""
    b, n = q.shape[0], coded.count
    keys, values = [], []
    if n:
        def decode(codec: BlockCodec, idx: torch.Tensor, sigma: torch.Tensor | None) -> torch.Tensor:
            codes = Codes(idx[:, :n].flatten(0, 1), None if sigma is None else sigma[:, :n].flatten(0, 1))
            return codec.decode(codes)[:, step].reshape(b, n, *idx.shape[2:3], -1)

        pos = coded.first_position.to(q.device)[:, None].long() + torch.arange(n, device=q.device)
        cos, sin = rope_angles(pos, key_codec.layout.head_dim, rope_theta)
        keys.append(apply_rope(decode(key_codec, coded.key_indices, coded.key_sigma), cos, sin, style=rope_style))
        values.append(decode(value_codec, coded.value_indices, None))
    cos, sin = rope_angles(fp_positions, fp_keys.shape[-1], rope_theta)
    keys.append(apply_rope(fp_keys.float(), cos, sin, style=rope_style))
    values.append(fp_values.float())
    k = torch.cat(keys, 1).double().transpose(1, 2)  # [B, H, S, D]
    v = torch.cat(values, 1).double().transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("bhd,bhsd->bhs", q.double(), k) / math.sqrt(q.shape[-1])
    if fp_mask is not None:
        keep = torch.cat([torch.ones(b, n, dtype=torch.bool, device=q.device), fp_mask.bool()], 1)
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v)


def plan_splits(n_coded: int, heads: int, block_n: int, *, programs: int) -> tuple[int, int]:
    """(coded splits, tokens per split): at most ``programs`` programs over the KV heads (at least one split
    each), each split a whole number of ``block_n`` tiles; one (empty) split when nothing is coded."""
    tiles = -(-n_coded // block_n)
    if not tiles:
        return 1, block_n
    per_split = -(-tiles // max(1, min(tiles, programs // heads))) * block_n
    return -(-n_coded // per_split), per_split


def _programs_for(device: torch.device) -> int:
    """Multiprocessors on CUDA (programs are planned per multiprocessor)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0  # the interpreter: one split per row unless asked (tests ask for several)


def decode_attention(
    q: torch.Tensor, tables: StepTables, coded: CodedTokens, *, fp_keys: torch.Tensor, fp_values: torch.Tensor,
    fp_positions: torch.Tensor, fp_mask: torch.Tensor | None, rope: RopeTable, block_n: int = 16,
    num_splits: int | None = None, num_warps: int = 4, max_position: int | None = None,
    programs_per_sm: int = 4, batch_per_program: int = 1, cache_hints: bool = False, backend: str = "auto",
    warps: int | None = None, tokens_per_iteration: int | None = None, lanes_per_token: int | None = None,
    key_float32: bool | None = None, rows_per_pass: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over coded and full-precision tokens (the Triton kernels).

    q [B, Hq, D] post-RoPE; ``tables`` from :func:`step_tables` for this site; ``coded`` the block's coded
    tokens; fp_keys / fp_values [B, S, H, D] pre-RoPE (sinks and window, S >= 1); fp_positions [B, S];
    fp_mask [B, S] (nonzero = attend) or None. Returns [B, Hq, D] in q's dtype (softmax scale 1/sqrt(D)).
    ``max_position``: an upper bound of every position (read from the tensors when None: a device sync).
    Launch shape: ``block_n`` tokens per tile and ``num_warps``; programs are (KV head, split, slice of
    ``batch_per_program`` sequences), about ``programs_per_sm`` per multiprocessor (``num_splits`` overrides);
    ``cache_hints``: tables loaded evict-last and the index stream evict-first.
    ``backend``: ``"cuda"`` the shared-memory kernel of :mod:`~loopvq_calib.kernels.decode_cuda` (``warps`` per
    block, ``tokens_per_iteration`` per lane group and step, ``lanes_per_token`` 8 or 16, ``key_float32``,
    ``rows_per_pass`` (most batch rows a block serves at once); defaults from :func:`~loopvq_calib.kernels.decode_cuda.default_launch`; ``num_splits`` per KV head), ``"triton"``
    the kernel of :mod:`~loopvq_calib.kernels.decode_triton`, ``"auto"`` for CUDA tensors the CUDA kernel where the
    site and the call fit it (:func:`~loopvq_calib.kernels.decode_cuda.launch` gives a plan) and it builds and launches,
    else (with a warning once per reason) and for other tensors Triton.
    """
    bsz, hq, d = q.shape
    heads, k = tables.value.shape[0], tables.value.shape[1]
    if hq % heads or d % 2:
        raise ValueError(f"need query heads ({hq}) a multiple of KV heads ({heads}) and an even head dim ({d})")
    if fp_keys.shape[1] < 1:
        raise ValueError("decode attention needs at least one full-precision token (the new one)")
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    n = coded.count
    if max_position is None:
        max_position = max(int(coded.first_position.max()) + n if n else 0, int(fp_positions.max()))
    if tables.tasq and n and coded.key_sigma is None:
        raise ValueError("TaSQ key tables need the coded tokens' key_sigma")
    if backend == "cuda" or (backend == "auto" and _on_cuda(q)):
        out = _cuda_attention(q, tables, coded, fp_keys=fp_keys, fp_values=fp_values, fp_positions=fp_positions, fp_mask=fp_mask, rope=rope, max_position=max_position,
                              backend=backend, warps=warps, tokens=tokens_per_iteration, lanes_per_token=lanes_per_token, num_splits=num_splits, key_float32=key_float32,
                              rows=rows_per_pass)
        if out is not None:
            return out
    slices = -(-bsz // batch_per_program)
    programs = num_splits * heads if num_splits else _programs_for(q.device) * programs_per_sm // slices
    splits, per_split = plan_splits(n, heads, block_n, programs=programs)
    inputs = kernel_inputs(q, tables, coded, fp_positions=fp_positions, fp_mask=fp_mask, rope=rope, rows=max_position + 1 + block_n)
    kidx, vidx, sig, fk, fv = coded.key_indices, coded.value_indices, inputs.sigma, fp_keys, fp_values
    qg = hq // heads
    acc = torch.empty(bsz, hq, splits + 1, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz, hq, splits + 1, 2, device=q.device, dtype=torch.float32)
    if not available(q.device):
        raise RuntimeError(f"the decode-attention kernels need triton and a CUDA GPU of compute capability 8.0+, "
                           f"or TRITON_INTERPRET=1 for CPU tensors; got device {q.device}")
    from ..kernels.decode_triton import _split_kernel

    _split_kernel[(heads, splits + 1, slices)](
        inputs.q, kidx, vidx, sig, tables.key_a, tables.key_b, tables.key_code_a, tables.key_code_b, tables.value,
        tables.value_code, inputs.first, inputs.cos, inputs.sin, fk, fv, inputs.fp_positions, inputs.fp_mask, acc, ml,
        bsz, batch_per_program, n, fk.shape[1], per_split, LOG2E / math.sqrt(d),
        kidx.stride(0), kidx.stride(1), kidx.stride(2), vidx.stride(0), vidx.stride(1), vidx.stride(2),
        sig.stride(0), sig.stride(1), fk.stride(0), fk.stride(1), fk.stride(2), fv.stride(0), fv.stride(1),
        fv.stride(2), inputs.fp_positions.stride(0),
        H=heads, QG=qg, QGP=_pow2(qg), D=d, K=k, HALF=tables.rope_style == "half", TASQ=tables.tasq, STEP=tables.step, HAS_MASK=fp_mask is not None, BLOCK_N=block_n,
        DP=_pow2(d), TABLE_EVICT="evict_last" if cache_hints else "", STREAM_EVICT="evict_first" if cache_hints else "",
        num_warps=num_warps,
    )
    return _merged(acc, ml, q.dtype)


_WARNED: set[str] = set()  # fallbacks to the Triton kernel already warned about in this process


def _on_cuda(q: torch.Tensor) -> bool:
    """Whether ``auto`` considers the CUDA kernel for this query (a CUDA tensor)."""
    return q.device.type == "cuda"


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)  # the caller of decode_attention


def _cuda_attention(q: torch.Tensor, tables: StepTables, coded: CodedTokens, *, fp_keys: torch.Tensor,
                    fp_values: torch.Tensor, fp_positions: torch.Tensor, fp_mask: torch.Tensor | None, rope: RopeTable,
                    max_position: int, backend: str, warps: int | None, tokens: int | None, lanes_per_token: int | None,
                    num_splits: int | None, key_float32: bool | None, rows: int | None) -> torch.Tensor | None:
    """The CUDA kernel's output, or None when the Triton kernel serves the call (``auto``: with a warning, once per
    reason, when the kernel refuses it, fails to build or fails to launch); ``backend="cuda"`` raises instead.
    The launch plan is worked out once (:func:`~loopvq_calib.kernels.decode_cuda.launch`) and handed to the launch."""
    from ..kernels import decode_cuda

    lanes = decode_cuda.site_lanes(tables, q.shape[1] // tables.value.shape[0], lanes_per_token)
    plan = decode_cuda.launch(lanes, q, fp_keys, fp_values=fp_values, coded=coded, warps=warps, tokens=tokens, rows=rows, num_splits=num_splits, key_float32=key_float32)
    if isinstance(plan, str):
        reason = plan
        if backend == "cuda":
            raise RuntimeError(f"the CUDA decode kernel does not take this call: {reason}")
        _warn_once(f"CUDA decode kernel skipped ({reason}); using the Triton kernel")
        return None
    inputs = kernel_inputs(q, tables, coded, fp_positions=fp_positions, fp_mask=fp_mask, rope=rope,
                           rows=decode_cuda.rope_rows(max_position, lanes.lanes))
    try:
        return decode_cuda.decode_attention_cuda(inputs, tables, lanes, coded=coded, fp_keys=fp_keys, fp_values=fp_values, plan=plan)
    except decode_cuda.BuildError as err:  # no NVRTC, a failed build or launch: the Triton kernel serves
        if backend == "cuda":
            raise
        _warn_once(f"CUDA decode kernel unavailable ({err}); using the Triton kernel")
        tables.lanes[lanes.lanes] = None
        return None


@dataclass
class KernelInputs:
    """What both kernels read besides the tables, in the dtypes they read: ``q`` contiguous, ``first`` [B]
    int32 (first coded position of each row), ``fp_positions`` [B, S] int32, ``fp_mask`` [B, S] int8 (or the
    positions again when there is no mask: never read; ``masked`` says which), ``sigma`` (TaSQ's fp16 sigmas, or a stand-in tensor
    when unread), ``cos`` / ``sin`` the RoPE table covering every position read."""

    q: torch.Tensor
    first: torch.Tensor
    fp_positions: torch.Tensor
    fp_mask: torch.Tensor
    sigma: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    masked: bool


def kernel_inputs(q: torch.Tensor, tables: StepTables, coded: CodedTokens, *, fp_positions: torch.Tensor,
                  fp_mask: torch.Tensor | None, rope: RopeTable, rows: int) -> KernelInputs:
    """The inputs of :class:`KernelInputs` for one call; the RoPE table covers at least ``rows`` positions."""
    cos, sin = rope.covering(rows, q.device)
    fpos = fp_positions.to(torch.int32).contiguous()
    return KernelInputs(
        q.contiguous(), coded.first_position.to(device=q.device, dtype=torch.int32).contiguous(), fpos,
        fp_mask.to(torch.int8).contiguous() if fp_mask is not None else fpos,
        coded.key_sigma if tables.tasq and coded.count else cos, cos, sin, fp_mask is not None)


def _merged(acc: torch.Tensor, ml: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Log-sum-exp merge of the splits: acc [B, Hq, S, D], ml [B, Hq, S, 2] (max, sum) -> [B, Hq, D]."""
    from ..kernels.decode_triton import _merge_kernel

    bsz, hq, splits, d = acc.shape
    out = torch.empty(bsz, hq, d, device=acc.device, dtype=dtype)
    _merge_kernel[(bsz * hq,)](acc, ml, out, S=splits, SP=_pow2(splits), D=d, DP=_pow2(d), num_warps=4)
    return out
