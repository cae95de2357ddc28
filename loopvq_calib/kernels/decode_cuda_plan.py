"""The CUDA decode kernel's launch (:mod:`~loopvq_calib.kernels.decode_cuda`), worked out from shapes and
strides alone: the settings a call may ask for (:class:`CudaDecodeLaunch`) and their defaults, the site's lane
tables, the rows of the RoPE table a launch reads, the shared memory it needs, and whether the kernel takes a
call: :func:`launch` gives its :class:`LaunchPlan`, else the reason (and the Triton kernel serves it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cuda_build
from .decode_inputs import CodedTokens, StepTables
from .decode_lanes import LaneTables, lane_tables

ACT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the dtypes the kernel takes: its ACT constant
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


DEFAULT_CUDA_LAUNCH = CudaDecodeLaunch()  # every setting at its default


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
    if any(t.dtype != torch.uint8 or index_vector(t) == 0 for t in indices):
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


def index_vector(idx: torch.Tensor) -> int:
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
