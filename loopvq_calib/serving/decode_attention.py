"""Decode attention straight from coded pages: one query token per sequence, the kernels and their reference.

At a KV site (loop step ``step`` of a block) a sequence's cache is: coded tokens (a block's indices, shared by
all its steps, plus TaSQ's fp16 sigma per step) and full-precision pre-RoPE sink/window tokens.
:func:`decode_attention` attends a query to both without writing decoded keys or values anywhere:

- **Step tables** (:func:`step_tables`, built once per site, weights-like): for every KV head, the step's
  codeword values per *channel*, ``[H, K, D]``, gathered from the codebook through the block's group layout
  and divided by TaSQ's channel weight; plus, per channel, the code (index column) that holds it. Any layout
  (loop-axis, channel, TaSQ's permuted groups) decodes the same way: channel d of a token is
  ``table[h, idx[token, h, code[h, d]], d]`` (times sigma for TaSQ keys). Key tables are kept per RoPE pair;
  a channels layout (:func:`~loopvq_calib.codes.layouts.channel_sets`) keeps its pairs in code order
  (:func:`pair_order`), so that a code's channels sit side by side as in LoopVQ's layout, and the kernels take
  each slot's query channels and cos/sin column from that order.
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

Two implementations, picked by the kernels' dispatch (:mod:`~loopvq_calib.kernels.backends`): on CUDA, where
the site and the call fit it, the CUDA kernel of :mod:`~loopvq_calib.kernels.decode_cuda` keeps a head's step
tables in shared memory and reads one vector per run of a code (tables in lane order, a lane group per token,
the query rotated by a recurrence); the Triton kernel of :mod:`~loopvq_calib.kernels.decode_triton` reads the
tables through the L1 cache, one gather per channel, and serves every other call. The Triton kernels need CUDA
compute capability 8.0+ or Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..codes.codec import BlockCodec, Codes
from ..codes.layouts import BlockLayout, channel_sets
from ..kernels import backends, decode_cuda, decode_cuda_plan
from ..kernels.backends import DECODE_CHOICES, DISPATCH, Backend, Candidate, pow2
from ..kernels.cuda_build import BuildError
from ..kernels.decode_cuda_plan import DEFAULT_CUDA_LAUNCH, CudaDecodeLaunch
from ..kernels.decode_inputs import CodedTokens, FullPrecisionTokens, KernelInputs, StepTables
from ..kernels.decode_triton import DEFAULT_TRITON_LAUNCH, TritonDecodeLaunch, decode_attention_triton
from ..models.common import apply_rope, pair_channels, rope_angles

__all__ = [
    "CodedTokens",
    "CudaDecodeLaunch",
    "FullPrecisionTokens",
    "KernelInputs",
    "RopeTable",
    "StepTables",
    "TritonDecodeLaunch",
    "channel_codes",
    "channel_table",
    "decode_attention",
    "decode_attention_reference",
    "kernel_inputs",
    "pair_order",
    "site_tables",
    "step_tables",
    "table_dtype",
]
VALUE_TERMS = 16  # tokens the CUDA kernel sums per lane in one packed half (tokens per lane group and step, <= 16)
KEY_TERMS = 8  # products per packed half of the CUDA kernel's key dot product (8 lanes per token: 16 channels)
QUERY_BOUND = 32.0  # assumed bound of a scaled query channel |q| log2(e) / sqrt(D): |q| up to ~250 at D = 128


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
    """The step's codeword value of every channel, [H, K, D] float32 (divided by TaSQ's weight), and the codes
    [H, D]."""
    code, pos = channel_codes(codec, step)
    cb = codec.codebook.detach().float().cpu()  # [Hc, nc, K, G]
    heads = codec.layout.kv_heads
    hc = torch.arange(heads) if cb.shape[0] == heads else torch.zeros(heads, dtype=torch.long)
    gc = code if cb.shape[1] == codec.layout.num_groups else torch.zeros_like(code)
    table = cb[hc[:, None], gc, :, pos].permute(0, 2, 1)  # [H, D, K] -> [H, K, D]
    if codec.transform is not None:
        table = table / codec.transform.weight.detach().float().cpu()[step][:, None, :]
    return table.contiguous(), code


def pair_order(layout: BlockLayout, rope_style: str) -> torch.Tensor | None:
    """The RoPE pairs of every head in code order, [H, D/2] (each code's c/2 pairs side by side, ascending), for
    a channels layout (:func:`~loopvq_calib.codes.layouts.channel_sets`) whose codes do not already hold
    consecutive pairs; None for any other layout (the tables then keep pair i in slot i)."""
    sets = channel_sets(layout, rope_style)
    if sets is None:
        return None
    d = layout.head_dim
    a, _ = pair_channels(d, rope_style)
    first = torch.zeros(d, dtype=torch.bool)
    first[a] = True
    pair_of = torch.empty(d, dtype=torch.long)
    pair_of[a] = torch.arange(d // 2)
    order = pair_of[sets[first[sets]].view(sets.shape[0], d // 2)]  # the first channel of each pair, in code order
    if torch.equal(order, torch.arange(d // 2).expand_as(order)):
        return None
    return order.expand(layout.kv_heads, -1)


def step_tables(
    key_codec: BlockCodec,
    value_codec: BlockCodec,
    step: int,
    *,
    rope_style: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float16,
) -> StepTables:
    """Build a site's :class:`StepTables` on ``device``; codeword values in ``dtype``, the key or the value
    tables in float32 where the CUDA kernel's half sums could overflow (:func:`table_dtype`). A channels layout's
    key tables hold the pairs in :func:`pair_order` (``key_pairs``: the kernels rotate the query by each slot's
    pair), every other layout's pair i in slot i."""
    kt, kc = channel_table(key_codec, step)
    vt, vc = channel_table(value_codec, step)
    heads, d = kc.shape
    order = pair_order(key_codec.layout, rope_style)
    slots = torch.arange(d // 2).expand(heads, -1) if order is None else order
    a, b = (c[slots] for c in pair_channels(d, rope_style))  # [H, D/2]: the channels of every slot's pair
    key_dtype = table_dtype(kt.abs().max().item(), dtype, "key")
    value_dtype = table_dtype(vt.abs().max().item(), dtype, "value")

    def put(t: torch.Tensor, as_dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=as_dtype).contiguous()

    def key(channels: torch.Tensor) -> torch.Tensor:
        return kt.gather(2, channels[:, None, :].expand(-1, kt.shape[1], -1))

    i32 = torch.int32
    return StepTables(
        put(key(a), key_dtype),
        put(key(b), key_dtype),
        put(kc.gather(1, a), i32),
        put(kc.gather(1, b), i32),
        put(vt, value_dtype),
        put(vc, i32),
        step,
        key_codec.transform is not None,
        rope_style,
        None if order is None else put(order, i32),
    )


def site_tables(
    codecs: dict[str, BlockCodec], names: dict[str, str], site: int, q: torch.Tensor, *, rope_style: str
) -> StepTables:
    """:func:`step_tables` of ``site`` (its block's key and value codecs ``codecs[names[kind]]``, the site's step in
    the block) on ``q``'s device: float32 tables for float32 queries, else float16."""
    kc, vc = (codecs[names[kind]] for kind in ("key", "value"))
    dtype = torch.float32 if q.dtype == torch.float32 else torch.float16
    return step_tables(kc, vc, kc.layout.sites.index(site), rope_style=rope_style, device=q.device, dtype=dtype)


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
            n = pow2(max(positions, 64))
            cos, sin = rope_angles(torch.arange(n, device=device)[None], self.head_dim, self.theta)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        return self.cos, self.sin


def decode_attention_reference(
    q: torch.Tensor,
    key_codec: BlockCodec,
    value_codec: BlockCodec,
    *,
    step: int,
    coded: CodedTokens,
    fp_keys: torch.Tensor,
    fp_values: torch.Tensor,
    fp_positions: torch.Tensor,
    fp_mask: torch.Tensor | None,
    rope_style: str,
    rope_theta: float,
) -> torch.Tensor:
    """The same attention in plain PyTorch (float64 after decoding): codecs decode the coded tokens, RoPE
    rotates keys at their positions, softmax over coded then full-precision tokens (``coded.live`` read here: a
    device sync). q [B, Hq, D] post-RoPE;
    fp_keys / fp_values [B, S, H, D] pre-RoPE; fp_positions [B, S]; fp_mask [B, S] bool (True = attend) or
    None. Returns [B, Hq, D] float64."""
    b, n = q.shape[0], coded.count if coded.live is None else min(coded.count, int(coded.live))
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


def decode_attention(
    q: torch.Tensor,
    tables: StepTables,
    coded: CodedTokens,
    *,
    fp: FullPrecisionTokens,
    rope: RopeTable,
    max_position: int | None = None,
    backend: Backend | str = Backend.AUTO,
    triton: TritonDecodeLaunch = DEFAULT_TRITON_LAUNCH,
    cuda: CudaDecodeLaunch = DEFAULT_CUDA_LAUNCH,
) -> torch.Tensor:
    """Attention of one query token per sequence over coded and full-precision tokens.

    q [B, Hq, D] post-RoPE; ``tables`` from :func:`step_tables` for this site; ``coded`` the block's coded
    tokens; ``fp`` the full-precision tokens (S >= 1). Returns [B, Hq, D] in q's dtype (softmax scale
    1/sqrt(D)). ``max_position``: an upper bound of every position (read from the tensors when None: a device
    sync). ``backend``: ``"cuda"`` the shared-memory kernel of :mod:`~loopvq_calib.kernels.decode_cuda`
    launched with ``cuda``; ``"triton"`` the kernel of :mod:`~loopvq_calib.kernels.decode_triton` launched with
    ``triton``; ``"auto"``: for CUDA tensors the CUDA kernel where the site and the call fit it
    (:func:`~loopvq_calib.kernels.decode_cuda_plan.launch` gives a plan) and it builds and launches, else (with a
    warning once per reason) and for other tensors Triton.
    """
    bsz, hq, d = q.shape
    heads = tables.value.shape[0]
    if hq % heads or d % 2:
        raise ValueError(f"need query heads ({hq}) a multiple of KV heads ({heads}) and an even head dim ({d})")
    if fp.keys.shape[1] < 1:
        raise ValueError("decode attention needs at least one full-precision token (the new one)")
    n = coded.count
    if max_position is None:
        max_position = max(int(coded.first_position.max()) + n if n else 0, int(fp.positions.max()))
    if tables.tasq and n and coded.key_sigma is None:
        raise ValueError("TaSQ key tables need the coded tokens' key_sigma")

    def run_triton() -> torch.Tensor:
        inputs = kernel_inputs(q, tables, coded, fp=fp, rope=rope, rows=max_position + 1 + triton.block_n)
        return decode_attention_triton(inputs, tables, coded, fp=fp, launch=triton)

    cuda_call = _CudaCall(q, tables, coded, fp=fp, rope=rope, max_position=max_position, settings=cuda)
    serve = {Backend.CUDA: cuda_call.candidate, Backend.TRITON: lambda listed: replace(listed, run=run_triton)}
    candidates = [serve[listed.backend](listed) for listed in backends.DECODE_CANDIDATES]  # in the kernels' order
    return DISPATCH.run(backend, candidates, what="decode attention", choices=DECODE_CHOICES, device=q.device)


def _on_cuda(q: torch.Tensor) -> bool:
    """Whether ``auto`` considers the CUDA kernel for this query (a CUDA tensor)."""
    return q.device.type == "cuda"


class _CudaCall:
    """One call's CUDA-kernel candidate: the site's lane tables and the launch plan worked out once (its
    ``unfit``), then the launch (its ``run``; a failed build or launch is a BuildError, and a failed launch
    keeps the site off the CUDA kernel)."""

    def __init__(
        self,
        q: torch.Tensor,
        tables: StepTables,
        coded: CodedTokens,
        *,
        fp: FullPrecisionTokens,
        rope: RopeTable,
        max_position: int,
        settings: CudaDecodeLaunch,
    ) -> None:
        self.q, self.tables, self.coded, self.fp, self.rope = q, tables, coded, fp, rope
        self.max_position, self.settings = max_position, settings
        self.lanes = self.plan = None

    def candidate(self, listed: Candidate) -> Candidate:
        """``listed``, the CUDA kernel's entry of the decode candidates, serving this call."""
        return replace(listed, auto=_on_cuda(self.q), unfit=self.unfit, run=self.run, fails_with=(BuildError,))

    def unfit(self) -> str:
        """Why the kernel does not take this call ('' when it does: the plan is kept for :meth:`run`)."""
        query_groups = self.q.shape[1] // self.tables.value.shape[0]
        self.lanes = decode_cuda_plan.site_lanes(self.tables, query_groups, self.settings.lanes_per_token)
        plan = decode_cuda_plan.launch(
            self.lanes, self.q, self.fp.keys, fp_values=self.fp.values, coded=self.coded, settings=self.settings
        )
        if isinstance(plan, str):
            return plan
        self.plan = plan
        return ""

    def run(self) -> torch.Tensor:
        inputs = kernel_inputs(
            self.q,
            self.tables,
            self.coded,
            fp=self.fp,
            rope=self.rope,
            rows=decode_cuda_plan.rope_rows(self.max_position, self.lanes.lanes),
        )
        try:
            return decode_cuda.decode_attention_cuda(
                inputs,
                self.tables,
                self.lanes,
                coded=self.coded,
                fp_keys=self.fp.keys,
                fp_values=self.fp.values,
                plan=self.plan,
            )
        except decode_cuda.LaunchError:
            self.tables.lanes[self.lanes.lanes] = None  # this site does not try the kernel again
            raise


def kernel_inputs(
    q: torch.Tensor, tables: StepTables, coded: CodedTokens, *, fp: FullPrecisionTokens, rope: RopeTable, rows: int
) -> KernelInputs:
    """The :class:`KernelInputs` of one call; the RoPE table covers at least ``rows`` positions."""
    cos, sin = rope.covering(rows, q.device)
    fpos = fp.positions.to(torch.int32).contiguous()
    return KernelInputs(
        q.contiguous(),
        coded.first_position.to(device=q.device, dtype=torch.int32).contiguous(),
        fpos,
        fp.mask.to(torch.int8).contiguous() if fp.mask is not None else fpos,
        coded.key_sigma if tables.tasq and coded.count else cos,
        cos,
        sin,
        fp.mask is not None,
    )
