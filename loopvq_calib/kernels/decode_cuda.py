"""Decode attention from coded pages with the step tables in shared memory: the CUDA kernel of
``decode_attention_device.cuh`` (its description, constants and device functions) followed by
``decode_attention.cu`` (the kernel), one text compiled with NVRTC at first use
(:mod:`~loopvq_calib.kernels.cuda_build`, one build per set of constants, a second or so) and launched on the
query's device, on its current stream.

The Triton kernel (:mod:`~loopvq_calib.kernels.decode_triton`) gathers every channel of every token from the
step tables through the L1 cache (one scattered access per channel); this kernel keeps a head's key and value
tables in shared memory in lane order (:mod:`~loopvq_calib.kernels.decode_lanes`: a group of lanes per token,
each lane reading runs of channels that share a code). One launch per call: each split of a (row, KV head)
writes its partial softmax state, and the split that arrives last merges them into the output (a per-(row,
head) arrival counter, reset by that split). :func:`launch` says whether a call fits (its plan, else the
reason, and the Triton kernel serves it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.devices import indexed_device
from . import cuda_build
from .cuda_build import LaunchError
from .decode_inputs import CodedTokens, KernelInputs, StepTables
from .decode_lanes import LaneTables, lane_tables

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("decode_attention_device.cuh", "decode_attention.cu")
)
KERNEL = "loopvq_decode_split"
ACT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CudaDecodeLaunch:
    """What a call asks of the CUDA kernel's launch (None: :func:`plan_launch`'s default): ``warps`` per block
    (one block per multiprocessor: the tables fill its shared memory), ``tokens_per_iteration`` per lane group
    and step (1 .. lanes, a power of two; a warp takes 32/lanes times as many), ``lanes_per_token`` 8 or 16,
    ``key_float32``: the key table in float32 in shared memory (no conversions), ``rows_per_pass``: the most
    batch rows a block serves at once, ``num_splits`` per KV head."""

    warps: int | None = None
    tokens_per_iteration: int | None = None
    lanes_per_token: int | None = None
    key_float32: bool | None = None
    rows_per_pass: int | None = None
    num_splits: int | None = None


def default_launch(query_groups: int) -> tuple[int, int, int, int]:
    """(warps per block, tokens per group and step, lanes per token, most batch rows per pass): 16 x 16 x 16 x R
    for one query head per KV head (at Ouro's shapes the register file and shared memory, not the warps, are the
    limit; 16 tokens per step halve the per-step costs of 8: the index-row copy, the reduction's tail, the
    weights' barrier; 8 lanes per token measured slower: their 64-byte table rows make two groups of a half-warp
    collide on banks), 8 x 4 x 16 x R for GQA (every query head keeps its own rotated query and accumulator);
    R = :data:`ROWS_PER_PASS`. :func:`plan_launch` lowers the default tokens to the lanes per token and, like
    the rows, until a float32 key table fits. Timed on the H200 (docs/decisions.md)."""
    return (16, 16, 16, ROWS_PER_PASS) if query_groups == 1 else (8, 4, 16, ROWS_PER_PASS)


ROWS_PER_PASS = 8  # most batch rows a block serves at once (see rows_per_pass)


def rows_per_pass(most: int, batch: int, warps: int) -> int:
    """Batch rows a block serves at once (WARPS / rows warps each): the largest divisor of ``warps`` up to
    ``most`` and the batch, so that one pass's fixed costs (first index rows, sink/window tokens, warp merge)
    are paid once for several rows."""
    if most < 1:
        raise ValueError(f"rows per pass must be at least 1, got {most}")
    return max(r for r in range(1, min(most, max(batch, 1), warps) + 1) if warps % r == 0)


def site_lanes(tables: StepTables, query_groups: int, lanes: int | None = None) -> LaneTables | None:
    """The site's :class:`LaneTables` for ``lanes`` per token (default: :func:`default_launch`'s), built once and
    kept in ``tables.lanes``."""
    count = lanes or default_launch(query_groups)[2]
    if count not in tables.lanes:
        tables.lanes[count] = lane_tables(tables, count)
    return tables.lanes[count]


def rope_rows(max_position: int, lanes: int) -> int:
    """Rows of the cos/sin table a launch with ``lanes`` per token may read, positions up to ``max_position``:
    a warp step's anchor reads the row of its first token plus the group index (up to 32/lanes - 1 past the
    last coded position), the recurrence the row 32/lanes; one spare row and at least 8."""
    return max(max_position + 32 // lanes + 1, 8)


def _align16(x: int) -> int:
    return (x + 15) // 16 * 16


def shared_layout(
    d: int,
    k: int,
    key_bytes: int,
    *,
    value_bytes: int,
    key_codes: int,
    value_codes: int,
    warps: int,
    query_groups: int,
    step_tokens: int,
    rows: int = 1,
) -> int:
    """Bytes of dynamic shared memory (the kernel source's KT_BYTES + VT_BYTES + STAGE_BYTES + the queries qs
    + pbuf + the channel maps); ``step_tokens`` tokens per warp step (TOK), ``rows`` batch rows per pass (RPB)."""
    stage = warps * 2 * step_tokens * (key_codes + value_codes)
    merge = warps * query_groups * (d + 2) * 4
    return (
        d * k * key_bytes
        + d * k * value_bytes
        + _align16(max(stage, merge))
        + rows * query_groups * d * 4
        + warps * query_groups * step_tokens * 4
        + 2 * d * 4
    )


@dataclass(frozen=True)
class LaunchPlan:
    """One call's launch, worked out once (:func:`launch`): ``warps`` per block, ``tokens`` per lane group and
    step, batch ``rows`` per pass, ``splits`` per KV head of ``split_len`` coded tokens, the key table in
    float32 or not, and the bytes of dynamic shared memory."""

    warps: int
    tokens: int
    rows: int
    splits: int
    split_len: int
    key_float32: bool
    shared: int


def launch(
    lanes: LaneTables | None,
    q: torch.Tensor,
    fp_keys: torch.Tensor,
    *,
    fp_values: torch.Tensor,
    coded: CodedTokens,
    settings: CudaDecodeLaunch,
) -> LaunchPlan | str:
    """The call's :class:`LaunchPlan`, or why it cannot run the CUDA kernel: no NVRTC kernel on q's device
    (:meth:`~loopvq_calib.kernels.cuda_build.CudaBuilds.unavailable`: an earlier failed build, not a CUDA
    device, a torch that cannot build) or :func:`plan_launch`'s reason with the device's shared memory and
    multiprocessors."""
    reason = cuda_build.BUILDS.unavailable(q.device)
    if reason:
        return reason
    props = torch.cuda.get_device_properties(q.device)
    return plan_launch(
        lanes,
        q,
        fp_keys,
        fp_values=fp_values,
        coded=coded,
        settings=settings,
        shared_limit=props.shared_memory_per_block_optin,
        sms=props.multi_processor_count,
    )


def plan_launch(
    lanes: LaneTables | None,
    q: torch.Tensor,
    fp_keys: torch.Tensor,
    *,
    fp_values: torch.Tensor,
    coded: CodedTokens,
    settings: CudaDecodeLaunch,
    shared_limit: int,
    sms: int,
) -> LaunchPlan | str:
    """The launch (defaults from :func:`default_launch`, rows per pass by :func:`rows_per_pass`, splits per KV
    head = ``sms`` over the heads; the key table in float32 by default only where its runs cannot be read as
    packed halves (odd runs) and it fits at one row per pass (at the rows given, if any; the default tokens per
    step, 16, drop to 8 where that makes it fit; ``key_float32=True`` that does not fit is refused); then the
    default rows per pass lowered until the call fits with that table: a float32 key table measured faster
    than more rows for TaSQ's keys), or why the kernel cannot read this call's tensors as it assumes: a
    site with lane tables, one dtype for q and the full-precision tokens, one-byte key and value indices stored
    head-major with aligned rows, fp16 TaSQ sigmas, unit inner strides, shared memory within ``shared_limit``
    bytes, and what it computes in 32 bits: every stride it takes (int arguments) and a token's offset inside
    its (row, head) index stream, below capacity x index bytes per token, which the head-major batch stride
    (heads x capacity x bytes per token) bounds. Row and head offsets are 64-bit, so the buffers' total size is
    not limited. Needs shapes and strides only (meta tensors do). Bad launch settings raise ValueError."""
    if lanes is None:
        return "the site has no lane tables (head dim not a multiple of 2 x lanes per token, or a failed launch)"
    if q.dtype not in ACT_CODES or fp_keys.dtype != q.dtype or fp_values.dtype != q.dtype:
        return f"dtypes q {q.dtype}, full-precision keys {fp_keys.dtype}, values {fp_values.dtype}"
    indices = (coded.key_indices, coded.value_indices)
    if any(t.dtype != torch.uint8 or _index_vector(t) == 0 for t in indices):
        return "indices are not uint8 stored head-major with 4-byte aligned rows"
    if lanes.value.dtype not in (torch.float16, torch.float32):
        return f"value table dtype {lanes.value.dtype}"
    read = [fp_keys, fp_values]
    if coded.key_sigma is not None and coded.count:
        if coded.key_sigma.dtype != torch.float16:
            return f"TaSQ sigmas in {coded.key_sigma.dtype}, not float16"
        read.append(coded.key_sigma)
    plan = _sized(lanes, q, coded, settings=settings, shared_limit=shared_limit, sms=sms)  # bad settings raise first
    if isinstance(plan, str):
        return plan
    if any(t.stride(-1) != 1 for t in read + list(indices)):
        return "a tensor's last dimension is not contiguous"
    if any(max(t.stride()) > INT32_MAX for t in read + list(indices)):
        return "a stride beyond 2**31 - 1 elements (the kernel takes strides as int32)"
    return plan


def _sized(
    lanes: LaneTables, q: torch.Tensor, coded: CodedTokens, *, settings: CudaDecodeLaunch, shared_limit: int, sms: int
) -> LaunchPlan | str:
    """:func:`plan_launch`'s warps, tokens, rows, key table and splits for a call whose tensors the kernel reads."""
    bsz, hq = q.shape[0], q.shape[1]
    heads = lanes.key.shape[0]
    qg = hq // heads
    w, u, _, r = default_launch(qg)
    warps, tokens, rows = settings.warps, settings.tokens_per_iteration, settings.rows_per_pass
    default_tokens = tokens is None
    warps, tokens = (warps if warps is not None else w), (min(u, lanes.lanes) if default_tokens else tokens)
    if tokens not in (1, 2, 4, 8, 16) or tokens > lanes.lanes or not 1 <= warps <= 32:
        raise ValueError(
            f"tokens_per_iteration must be a power of two up to the lanes per token ({lanes.lanes}) and "
            f"warps 1..32, got {tokens} and {warps}"
        )
    wanted = lanes.run_key % 2 == 1 if settings.key_float32 is None else settings.key_float32
    given = rows is not None
    rows = rows_per_pass(rows if given else r, bsz, warps)

    def need(t: int, key_dtype: torch.dtype | None, at_rows: int) -> int:
        return launch_shared(lanes, coded, warps, query_groups=qg, tokens=t, key_dtype=key_dtype, rows=at_rows)

    def need32(t: int) -> int:
        return need(t, torch.float32, rows if given else 1)

    if wanted and default_tokens:  # default tokens above 8 give way to a float32 key table that fits at 8
        tokens = next((t for t in (tokens, 8) if t <= tokens and need32(t) <= shared_limit), tokens)
    wide = wanted and need32(tokens) <= shared_limit  # float32 wanted and fits
    if settings.key_float32 and not wide:
        return f"a float32 key table needs {need32(tokens)} bytes of shared memory, {shared_limit} available"
    key_dtype = torch.float32 if wide else None
    while not given and rows > 1 and need(tokens, key_dtype, rows) > shared_limit:
        rows = rows_per_pass(rows - 1, bsz, warps)  # default rows give way to the key table
    n, splits = coded.count, settings.num_splits
    if splits is None:
        splits = max(1, min(max(sms // heads, 1), -(-n // (warps // rows * 32 // lanes.lanes * tokens))))
    shared = need(tokens, key_dtype, rows)
    if shared > shared_limit:
        return f"{shared} bytes of shared memory, {shared_limit} available"
    return LaunchPlan(warps, tokens, rows, splits, -(-max(n, 1) // splits), wide, shared)


def _index_vector(idx: torch.Tensor) -> int:
    """Bytes per copy of a [B, N, H, n] index tensor's token rows (16 or 4), 0 when its rows are not stored
    head-major (token t of a (row, head) at t * n) with that alignment."""
    n = idx.shape[3]
    if idx.stride(3) != 1 or idx.stride(1) != n:
        return 0
    for vec in (16, 4):
        if n % vec == 0 and idx.data_ptr() % vec == 0 and idx.stride(0) % vec == 0 and idx.stride(2) % vec == 0:
            return vec
    return 0


def launch_shared(
    lanes: LaneTables,
    coded: CodedTokens,
    warps: int,
    *,
    query_groups: int,
    tokens: int,
    key_dtype: torch.dtype | None = None,
    rows: int = 1,
) -> int:
    """Shared memory of a launch with the key table in ``key_dtype`` (default: the tables' own)."""
    heads, _, k, _, _ = lanes.key.shape
    d = lanes.key_channel.shape[1]
    kb = torch.finfo(key_dtype or lanes.key.dtype).bits // 8
    return shared_layout(
        d,
        k,
        kb,
        value_bytes=lanes.value.element_size(),
        key_codes=coded.key_indices.shape[3],
        value_codes=coded.value_indices.shape[3],
        warps=warps,
        query_groups=query_groups,
        step_tokens=32 // lanes.lanes * tokens,
        rows=rows,
    )


def _float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as a signed int (the kernel reinterprets it)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


@functools.lru_cache(maxsize=1)
def kernel_source() -> str:
    """The kernel's source text without its constants: the device functions, then the kernel (read once)."""
    return "".join(path.read_text() for path in SOURCES)


def checked_plan(
    lanes: LaneTables,
    inputs: KernelInputs,
    *,
    coded: CodedTokens,
    fp_keys: torch.Tensor,
    fp_values: torch.Tensor,
    settings: CudaDecodeLaunch,
    plan: LaunchPlan | None,
) -> LaunchPlan:
    """``plan`` checked (its rows per pass divide its warps; no launch settings next to it, which it would
    override), or when None :func:`launch`'s plan from ``settings``, whose refusal raises LaunchError."""
    if plan is None:
        planned = launch(lanes, inputs.q, fp_keys, fp_values=fp_values, coded=coded, settings=settings)
        if isinstance(planned, str):
            raise LaunchError(f"{KERNEL} refuses this call: {planned}")
        return planned
    asked = [
        f.name
        for f in dataclasses.fields(settings)
        if f.name != "lanes_per_token" and getattr(settings, f.name) is not None
    ]
    if asked:
        raise ValueError(f"a launch plan and {', '.join(asked)} given: pass one or the other")
    if not 1 <= plan.rows <= plan.warps or plan.warps % plan.rows:
        raise ValueError(f"a plan's rows per pass ({plan.rows}) must divide its warps ({plan.warps})")
    return plan


def decode_attention_cuda(
    inputs: KernelInputs,
    tables: StepTables,
    lanes: LaneTables,
    *,
    coded: CodedTokens,
    fp_keys: torch.Tensor,
    fp_values: torch.Tensor,
    settings: CudaDecodeLaunch = CudaDecodeLaunch(),
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """Run the kernel; returns the attention [B, Hq, D] in q's dtype (the splits merged by the last to arrive).

    ``inputs``: the call's kernel inputs (the RoPE table of at least :func:`rope_rows` rows); ``lanes`` the
    site's tables for the lanes per token to launch with; ``plan`` the call's :class:`LaunchPlan` from
    :func:`launch`, else worked out here from ``settings`` (:func:`checked_plan`). Raises BuildError when the
    kernel cannot be built, LaunchError when it does not launch."""
    plan = checked_plan(lanes, inputs, coded=coded, fp_keys=fp_keys, fp_values=fp_values, settings=settings, plan=plan)
    q = inputs.q
    bsz, hq, d = q.shape
    heads, _, k, _, _ = lanes.key.shape
    n = coded.count
    key = lanes.key_table(plan.key_float32)
    kidx, vidx = coded.key_indices, coded.value_indices
    sig, fpos = inputs.sigma, inputs.fp_positions
    if tables.tasq and n:
        sig = sig[:, :, tables.step]  # the kernel reads the step's column (one build serves every step)
    vec = min(_index_vector(kidx), _index_vector(vidx))
    defines = (
        ("D", d),
        ("LPT", lanes.lanes),
        ("RPB", plan.rows),
        ("QG", hq // heads),
        ("U", plan.tokens),
        ("WARPS", plan.warps),
        ("KCB", k),
        ("NKC", kidx.shape[3]),
        ("NVC", vidx.shape[3]),
        ("RK", lanes.run_key),
        ("KMIX", int(lanes.key_mixed)),
        ("RV", lanes.run_value),
        ("KG", lanes.key_group),
        ("VG", lanes.value_group),
        ("KT32", int(key.dtype == torch.float32)),
        ("VT32", int(lanes.value.dtype == torch.float32)),
        ("CHEB", int(lanes.value.dtype != torch.float32)),
        ("TASQ", int(tables.tasq)),
        ("PAIRS", int(lanes.key_pair is not None)),
        ("HAS_MASK", int(inputs.masked)),
        ("ACT", ACT_CODES[q.dtype]),
        ("IDXVEC", vec),
        ("LIVE", int(coded.live is not None)),
    )
    device = indexed_device(q.device)
    builds = cuda_build.BUILDS
    kernel = builds.kernel(kernel_source(), KERNEL, defines=defines, shared=plan.shared, device=device.index)
    acc = torch.empty(bsz, hq, plan.splits, d, device=q.device, dtype=torch.float32)  # every split's partial
    ml = torch.empty(bsz, hq, plan.splits, 2, device=q.device, dtype=torch.float32)  # result: (acc, max, sum)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype)
    strides = [
        kidx.stride(0),
        kidx.stride(2),
        vidx.stride(0),
        vidx.stride(2),
        *sig.stride()[:2],
        *fp_keys.stride()[:3],
        *fp_values.stride()[:3],
        fpos.stride(0),
    ]  # within int32: launch checked
    pairs = lanes.key_column if lanes.key_pair is None else lanes.key_pair  # unread without PAIRS
    args = [
        q,
        kidx,
        vidx,
        sig,
        key,
        lanes.value,
        lanes.key_column,
        lanes.value_column,
        lanes.key_channel,
        lanes.value_channel,
        pairs,
        inputs.first,
        inputs.cos,
        inputs.sin,
        fp_keys,
        fp_values,
        fpos,
        inputs.fp_mask,
        acc,
        ml,
        builds.counters(device, bsz * heads),
        out,
        inputs.first if coded.live is None else coded.live,
        bsz,
        n,
        fp_keys.shape[1],
        plan.split_len,
        _float_bits(1.4426950408889634 / math.sqrt(d)),
        *strides,
    ]
    try:
        with torch.cuda.device(q.device):  # q's device and its current stream, whichever device is current
            kernel(
                grid=(heads, plan.splits, 1),
                block=(32 * plan.warps, 1, 1),
                shared_mem=plan.shared,
                args=args,
                stream=torch.cuda.current_stream(q.device),
            )
    except RuntimeError as err:
        raise LaunchError(f"{KERNEL} launch with {dict(defines)}: {err}") from err
    return out
