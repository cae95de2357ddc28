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
head) arrival counter, reset by that split). :func:`~loopvq_calib.kernels.decode_cuda_plan.launch` says whether
a call fits (its plan, else the reason, and the Triton kernel serves it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from pathlib import Path
from typing import Any

import torch

from ..runtime.devices import indexed_device
from . import cuda_build, decode_cuda_plan
from .cuda_build import LaunchError
from .decode_cuda_plan import ACT_CODES, DEFAULT_CUDA_LAUNCH, CudaDecodeLaunch, LaunchPlan, index_vector
from .decode_inputs import CodedTokens, KernelInputs, StepTables
from .decode_lanes import LaneTables

SOURCES = tuple(
    Path(__file__).with_name("csrc") / name for name in ("decode_attention_device.cuh", "decode_attention.cu")
)
KERNEL = "loopvq_decode_split"


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
    override), or when None :func:`~loopvq_calib.kernels.decode_cuda_plan.launch`'s plan from ``settings``, whose
    refusal raises LaunchError."""
    if plan is None:
        planned = decode_cuda_plan.launch(lanes, inputs.q, fp_keys, fp_values=fp_values, coded=coded, settings=settings)
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
    settings: CudaDecodeLaunch = DEFAULT_CUDA_LAUNCH,
    plan: LaunchPlan | None = None,
) -> torch.Tensor:
    """Run the kernel; returns the attention [B, Hq, D] in q's dtype (the splits merged by the last to arrive).

    ``inputs``: the call's kernel inputs (the RoPE table of at least
    :func:`~loopvq_calib.kernels.decode_cuda_plan.rope_rows` rows); ``lanes`` the site's tables for the lanes per
    token to launch with; ``plan`` the call's :class:`LaunchPlan` from
    :func:`~loopvq_calib.kernels.decode_cuda_plan.launch`, else worked out here from ``settings``
    (:func:`checked_plan`). Raises BuildError when the kernel cannot be built, LaunchError when it does not
    launch."""
    plan = checked_plan(lanes, inputs, coded=coded, fp_keys=fp_keys, fp_values=fp_values, settings=settings, plan=plan)
    q = inputs.q
    bsz, hq, d = q.shape
    heads = lanes.key.shape[0]
    n = coded.count
    key = lanes.key_table(plan.key_float32)
    kidx, vidx = coded.key_indices, coded.value_indices
    sig, fpos = inputs.sigma, inputs.fp_positions
    if tables.tasq and n:
        sig = sig[:, :, tables.step]  # the kernel reads the step's column (one build serves every step)
    defines = _kernel_defines(inputs, tables, lanes, coded=coded, plan=plan, key=key)
    device = indexed_device(q.device)
    builds = cuda_build.BUILDS
    kernel = builds.kernel(kernel_source(), KERNEL, defines=defines, shared=plan.shared, device=device.index)
    acc = torch.empty(bsz, hq, plan.splits, d, device=q.device, dtype=torch.float32)  # every split's partial
    ml = torch.empty(bsz, hq, plan.splits, 2, device=q.device, dtype=torch.float32)  # result: (acc, max, sum)
    out = torch.empty(bsz, hq, d, device=q.device, dtype=q.dtype)
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
        *_strides(coded, sig, fp_keys=fp_keys, fp_values=fp_values, fp_positions=fpos),  # within int32: launch checked
    ]
    _launch(kernel, plan, args, device=q.device, heads=heads, defines=defines)
    return out


def _kernel_defines(
    inputs: KernelInputs,
    tables: StepTables,
    lanes: LaneTables,
    *,
    coded: CodedTokens,
    plan: LaunchPlan,
    key: torch.Tensor,
) -> tuple[tuple[str, int], ...]:
    """The constants ``#define``d into the kernel's source for this call (one build per distinct set); ``key``
    the key table it reads."""
    hq, d = inputs.q.shape[1:]
    heads, _, k, _, _ = lanes.key.shape
    kidx, vidx = coded.key_indices, coded.value_indices
    vec = min(index_vector(kidx), index_vector(vidx))
    return (
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
        ("ACT", ACT_CODES[inputs.q.dtype]),
        ("IDXVEC", vec),
        ("LIVE", int(coded.live is not None)),
    )


def _strides(
    coded: CodedTokens,
    sigma: torch.Tensor,
    *,
    fp_keys: torch.Tensor,
    fp_values: torch.Tensor,
    fp_positions: torch.Tensor,
) -> list[int]:
    """The strides the kernel takes, in its argument order."""
    kidx, vidx = coded.key_indices, coded.value_indices
    return [
        kidx.stride(0),
        kidx.stride(2),
        vidx.stride(0),
        vidx.stride(2),
        *sigma.stride()[:2],
        *fp_keys.stride()[:3],
        *fp_values.stride()[:3],
        fp_positions.stride(0),
    ]


def _launch(
    kernel: Any,
    plan: LaunchPlan,
    args: list[Any],
    *,
    device: torch.device,
    heads: int,
    defines: tuple[tuple[str, int], ...],
) -> None:
    """One launch of (KV head, split) blocks on ``device`` and its current stream, whichever device is current;
    a failure is a LaunchError naming the constants."""
    try:
        with torch.cuda.device(device):
            kernel(
                grid=(heads, plan.splits, 1),
                block=(32 * plan.warps, 1, 1),
                shared_mem=plan.shared,
                args=args,
                stream=torch.cuda.current_stream(device),
            )
    except RuntimeError as err:
        raise LaunchError(f"{KERNEL} launch with {dict(defines)}: {err}") from err
