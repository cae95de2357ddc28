"""Decode attention from coded pages with the step tables in shared memory: the CUDA kernel of
``decode_attention.cu``, compiled with NVRTC at first use (``torch.cuda._compile_kernel``, one build per
shape, a second or so) and launched on the current stream.

The Triton kernel of :mod:`~loopvq_calib.decode_attention` gathers every channel of every token from the step
tables through the L1 cache (one scattered access per channel); this kernel keeps a head's key and value
tables in shared memory and reads one vector per *code*: the tables are reordered into **slot order**
(channels sorted by the code that holds them), so lane L of a warp owns slots ``[L*D/32, (L+1)*D/32)`` and
the slots of one run (``run`` consecutive slots) share one index byte. Loop-axis and channel layouts give a
run of ``D/32`` slots (one index byte and one 8-byte table read per lane and token at D 128); TaSQ's
permuted layouts give shorter runs. RoPE is applied on the query side in slot order (each slot's pair
partner and frequency), so decoded keys are never rotated. :func:`slot_tables` says whether a site fits
(head dim a multiple of 32, indices of one byte, tables that fit in shared memory); the caller falls back to
the Triton kernel otherwise.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cu")
KERNEL = "loopvq_decode_split"
ACT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
INT32_MAX = 2**31 - 1


@dataclass
class SlotTables:
    """One site's step tables in slot order (see the module docstring).

    ``key`` / ``value`` [H, K, D] (float16 or float32): codeword value of every slot; ``key_code`` [H, D /
    run_key] / ``value_code`` [H, D / run_value] int32: the index column of every run; ``key_channel``,
    ``key_partner`` [H, D] int32: the slot's channel and its RoPE partner channel; ``key_freq`` [H, D] int32:
    its RoPE pair (column of the cos/sin table); ``key_sign`` [H, D] float32: +1 for a pair's first channel,
    -1 for its second; ``value_channel`` [H, D] int32."""

    key: torch.Tensor
    value: torch.Tensor
    key_code: torch.Tensor
    value_code: torch.Tensor
    key_channel: torch.Tensor
    key_partner: torch.Tensor
    key_freq: torch.Tensor
    key_sign: torch.Tensor
    value_channel: torch.Tensor
    run_key: int
    run_value: int


def _slot_order(code: torch.Tensor) -> torch.Tensor:
    """Channels of every head sorted by code (then channel): [H, D]."""
    d = code.shape[1]
    return torch.argsort(code.long() * d + torch.arange(d, device=code.device), dim=1)


def _run(code_in_slot_order: torch.Tensor, per_lane: int) -> int:
    """The longest run length dividing ``per_lane`` such that every aligned run of slots shares one code."""
    h, d = code_in_slot_order.shape
    for r in sorted((r for r in range(1, per_lane + 1) if per_lane % r == 0), reverse=True):
        runs = code_in_slot_order.view(h, d // r, r)
        if bool((runs == runs[:, :, :1]).all()):
            return r
    return 1


def slot_tables(tables) -> SlotTables | None:
    """:class:`SlotTables` of a :class:`~loopvq_calib.decode_attention.StepTables`, or None when the site does
    not fit this kernel (head dim not a multiple of 32)."""
    from .models.common import pair_channels

    heads, k, d = tables.value.shape
    if d % 32:
        return None
    dev = tables.value.device
    a, b = (c.to(dev) for c in pair_channels(d, tables.rope_style))
    key = torch.empty(heads, k, d, dtype=tables.key_a.dtype, device=dev)
    key[:, :, a], key[:, :, b] = tables.key_a, tables.key_b
    kcode = torch.empty(heads, d, dtype=torch.int32, device=dev)
    kcode[:, a], kcode[:, b] = tables.key_code_a, tables.key_code_b
    partner, freq = torch.empty(d, dtype=torch.long, device=dev), torch.empty(d, dtype=torch.long, device=dev)
    partner[a], partner[b] = b, a
    freq[a] = freq[b] = torch.arange(d // 2, device=dev)
    sign = torch.ones(d, device=dev)
    sign[b] = -1.0
    korder, vorder = _slot_order(kcode), _slot_order(tables.value_code)
    kcode_s, vcode_s = kcode.gather(1, korder), tables.value_code.gather(1, vorder)
    rk, rv = _run(kcode_s, d // 32), _run(vcode_s, d // 32)

    def reorder(table: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return table.gather(2, order[:, None, :].expand(-1, k, -1)).contiguous()

    i32 = torch.int32
    return SlotTables(
        reorder(key, korder), reorder(tables.value, vorder), kcode_s[:, ::rk].to(i32).contiguous(),
        vcode_s[:, ::rv].to(i32).contiguous(), korder.to(i32).contiguous(), partner[korder].to(i32).contiguous(),
        freq[korder].to(i32).contiguous(), sign[korder].contiguous(), vorder.to(i32).contiguous(), rk, rv)


def default_launch(slots: SlotTables) -> tuple[int, int]:
    """(warps per block, tokens per warp step): 16 x 8 where every lane reads one run per kind (loop-axis and
    channel layouts: 128 registers, no spills), 8 x 8 for shorter runs (TaSQ's permuted keys need more
    registers per lane). Measured on the H200 (docs/quantized-cache.md)."""
    per_lane = slots.key.shape[2] // 32
    return (16, 8) if slots.run_key == per_lane and slots.run_value == per_lane else (8, 8)


def shared_bytes(slots: SlotTables, warps: int, query_groups: int) -> int:
    """Dynamic shared memory of one block: both tables, the warps' merge area and weight buffers (<= 32 tokens)."""
    heads, k, d = slots.key.shape
    return 2 * k * d * slots.key.element_size() + warps * query_groups * (d + 2 + 32) * 4


def fits(slots: SlotTables | None, q: torch.Tensor, fp_keys: torch.Tensor, fp_values: torch.Tensor, coded,
         warps: int | None) -> bool:
    """Whether this call can run the CUDA kernel (else the Triton one serves it): the dtypes, strides and sizes
    the kernel reads (one-byte key and value indices, fp16 TaSQ sigmas, 32-bit offsets) and its shared memory;
    never again in this process after a build failed (:data:`BUILD_FAILED`)."""
    if slots is None or q.device.type != "cuda" or not hasattr(torch.cuda, "_compile_kernel") or BUILD_FAILED:
        return False
    if q.dtype not in ACT_CODES or fp_keys.dtype != q.dtype or fp_values.dtype != q.dtype:
        return False
    indices = (coded.key_indices, coded.value_indices)
    if any(t.dtype != torch.uint8 for t in indices) or slots.key.dtype not in (torch.float16, torch.float32):
        return False
    read = [fp_keys, fp_values, *indices]
    if coded.key_sigma is not None and coded.count:
        if coded.key_sigma.dtype != torch.float16:
            return False
        read.append(coded.key_sigma)
    limit = torch.cuda.get_device_properties(q.device).shared_memory_per_block_optin
    if shared_bytes(slots, warps or default_launch(slots)[0], q.shape[1] // slots.key.shape[0]) > limit:
        return False
    return all(t.stride(-1) == 1 and t.numel() <= INT32_MAX and max(t.stride()) <= INT32_MAX for t in read)


def _float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as a signed int (the kernel reinterprets it)."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


class BuildError(RuntimeError):
    """The kernel could not be built or configured here (no NVRTC, a compile error, a shared-memory limit)."""


BUILD_FAILED: list[BuildError] = []  # the first failed build: later calls go to Triton without trying again


@functools.lru_cache(maxsize=None)
def _compiled(defines: tuple[tuple[str, int], ...], shared: int, device: int):
    """The kernel built for one set of constants (NVRTC), with its shared-memory limit raised."""
    text = "".join(f"#define {name} {value}\n" for name, value in defines) + SOURCE.read_text()
    try:
        with torch.cuda.device(device):
            kernel = torch.cuda._compile_kernel(text, KERNEL)
            if shared >= 48 * 1024 and hasattr(kernel, "set_shared_memory_config"):
                kernel.set_shared_memory_config(shared)
            elif shared >= 48 * 1024:  # older torch: raise the function's dynamic shared-memory limit directly
                from torch.cuda._utils import _get_gpu_runtime_library

                if _get_gpu_runtime_library().cuFuncSetAttribute(kernel.func, 8, shared):
                    raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory = {shared}) failed")
    except (RuntimeError, OSError, AttributeError) as err:
        BUILD_FAILED.append(BuildError(f"{KERNEL} with {dict(defines)}: {err}"))
        raise BUILD_FAILED[-1] from err
    return kernel


def decode_attention_cuda(
    q: torch.Tensor, tables, slots: SlotTables, coded, fp_keys: torch.Tensor, fp_values: torch.Tensor,
    fp_positions: torch.Tensor, fp_mask: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    warps: int | None = None, tokens_per_iteration: int | None = None, num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the split kernel; returns (acc [B, Hq, S, D], max/sum [B, Hq, S, 2]) for the log-sum-exp merge.

    Arguments as :func:`~loopvq_calib.decode_attention.decode_attention` (``cos``/``sin`` the RoPE table,
    covering every position); ``warps`` per block (one block per multiprocessor: the tables fill its shared
    memory), ``tokens_per_iteration`` tokens per warp step (4, 8, 16 or 32), both from :func:`default_launch`
    when None; splits per KV head default to the multiprocessors over the heads."""
    warps = warps or default_launch(slots)[0]
    tokens_per_iteration = tokens_per_iteration or default_launch(slots)[1]
    if tokens_per_iteration not in (1, 2, 4, 8, 16, 32) or not 1 <= warps <= 32:
        raise ValueError(f"tokens_per_iteration must divide 32 and warps be 1..32, got {tokens_per_iteration} and {warps}")
    bsz, hq, d = q.shape
    heads, k = slots.key.shape[:2]
    n = coded.count
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = max(1, min(sms // heads, -(-n // (warps * tokens_per_iteration))))
    split_len = -(-max(n, 1) // num_splits)
    qg = hq // heads
    shared = shared_bytes(slots, warps, qg)
    defines = (("D", d), ("SPL", d // 32), ("RUNK", slots.run_key), ("RUNV", slots.run_value), ("QG", qg),
               ("U", tokens_per_iteration), ("WARPS", warps), ("KCB", k), ("TASQ", int(tables.tasq)),
               ("STEP", tables.step), ("HAS_MASK", int(fp_mask is not None)), ("ACT", ACT_CODES[q.dtype]),
               ("TAB32", int(slots.key.dtype == torch.float32)))
    kernel = _compiled(defines, shared, q.device.index if q.device.index is not None else torch.cuda.current_device())
    kidx, vidx = coded.key_indices, coded.value_indices
    sig = coded.key_sigma if tables.tasq and n else cos
    fpos = fp_positions.to(torch.int32).contiguous()
    fmask = fp_mask.to(torch.int8).contiguous() if fp_mask is not None else fpos
    p0 = coded.first_position.to(device=q.device, dtype=torch.int32).contiguous()
    acc = torch.empty(bsz, hq, num_splits, d, device=q.device, dtype=torch.float32)
    ml = torch.empty(bsz, hq, num_splits, 2, device=q.device, dtype=torch.float32)
    strides = [*kidx.stride()[:3], *vidx.stride()[:3], *sig.stride()[:2], *fp_keys.stride()[:3],
               *fp_values.stride()[:3], fpos.stride(0)]
    if max(strides) > INT32_MAX:
        raise ValueError("tensor strides beyond 2**31 - 1 elements: use the Triton kernel")
    kernel(grid=(heads, num_splits, 1), block=(32 * warps, 1, 1), shared_mem=shared, args=[
        q.contiguous(), kidx, vidx, sig, slots.key, slots.value, slots.key_code, slots.value_code,
        slots.key_channel, slots.key_partner, slots.key_freq, slots.key_sign, slots.value_channel, p0, cos, sin,
        fp_keys, fp_values, fpos, fmask, acc, ml, bsz, n, fp_keys.shape[1], split_len,
        _float_bits(1.4426950408889634 / math.sqrt(d)), *strides])
    return acc, ml
