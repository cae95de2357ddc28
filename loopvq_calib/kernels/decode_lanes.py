"""The step tables of one site in **lane order**, as the CUDA decode kernel (:mod:`~loopvq_calib.kernels.decode_cuda`,
``decode_attention.cu``) keeps them in shared memory.

A token is served by a group of ``lanes`` lanes (8 or 16), lane ``l`` owning ``D/lanes`` key channels (both
channels of ``D/(2 lanes)`` RoPE pairs, so the query's rotation is lane-local) and ``D/lanes`` value channels;
the channels a lane reads from one code form a *run* (one index byte and one vector load per token). Loop-axis
layouts give runs of 4 (Ouro, 16 lanes: a lane reads 2 key and 2 value codes per token, the value codes' index
bytes in one 16-bit load; with 8 lanes 4 and 4, in one 16-bit and one 32-bit load); TaSQ's free keys give
runs of 1. A lane owns the pairs of its slots of the step tables: pair i in slot i, or a channels layout's pairs
in code order (``StepTables.key_pairs``), whose codes then give runs as long as the loop-axis layout's (both
channels of c/2 pairs: ``key_mixed``). :func:`lane_tables` says whether a site fits (head dim a multiple of 2
lanes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.common import pair_channels
from .decode_inputs import StepTables

LANE_CHOICES = (8, 16)  # lanes per token the kernel is built for


@dataclass
class LaneTables:
    """One site's step tables in lane order (see the module docstring), every tensor per KV head.

    ``key`` [H, D/L/run_key, K, L, run_key] (L = ``lanes`` per token): the value of
    lane l's key run r at codeword k; a lane's key registers are the first channels of its pairs then the
    second ones (``key_mixed``: a run holds both channels of run_key/2 pairs, else only first or only second
    channels; ``key_wide``: the same in float32); ``value`` [H, D/L/run_value, K, L, run_value] (float16 or
    float32); ``key_column`` [H, L, runs] / ``value_column`` int32: the index column (code) of every run;
    ``key_channel`` [H, D] int32: the channel of lane l's key register j at l*D/L + j; ``value_channel`` [H, D]
    likewise; ``key_group`` / ``value_group``: how many runs' index bytes sit in adjacent columns (1, 2 or 4:
    read with one load); ``key_pair`` [H, D/2] int32: the RoPE pair (cos/sin column) of lane l's pair j at
    l*D/(2L) + j, or None when that is pair l*D/(2L) + j (the kernel then reads consecutive columns)."""

    key: torch.Tensor
    value: torch.Tensor
    key_column: torch.Tensor
    value_column: torch.Tensor
    key_channel: torch.Tensor
    value_channel: torch.Tensor
    run_key: int
    key_mixed: bool
    run_value: int
    lanes: int
    key_group: int
    value_group: int
    key_pair: torch.Tensor | None = None
    key_wide: torch.Tensor | None = None  # the key table in float32 (exact), made on first use

    def key_table(self, float32: bool) -> torch.Tensor:
        """The key table a launch reads: as built, or widened to float32 (no conversions in the kernel)."""
        if self.key.dtype == torch.float32 or not float32:
            return self.key
        if self.key_wide is None:
            self.key_wide = self.key.float()
        return self.key_wide


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


def key_registers(per_lane: int, run: int, mixed: bool) -> list[int]:
    """Register (0 .. per_lane-1: first channels of the lane's pairs, then second channels) of every position
    of every run, in run-major order (the kernel's REGK)."""
    pairs = per_lane // 2
    if not mixed:
        return list(range(per_lane))
    return [
        r * (run // 2) + i if i < run // 2 else pairs + r * (run // 2) + i - run // 2
        for r in range(per_lane // run)
        for i in range(run)
    ]


def _key_runs(code_a: torch.Tensor, code_b: torch.Tensor, per_lane: int) -> tuple[int, bool]:
    """(run length, mixed) of the keys: the longest runs whose positions share one code for every head and lane.
    code_a / code_b [H, L, pairs per lane]: the code of each pair's first / second channel."""
    heads, lanes = code_a.shape[:2]
    regs = torch.cat([code_a, code_b], 2)  # [H, 16, per_lane] code of every register
    for run in range(per_lane, 0, -1):
        for mixed in (False, True):
            if per_lane % run or (mixed and (run % 2 or (per_lane // 2) % (run // 2))):
                continue
            if not mixed and run > per_lane // 2 and run != per_lane:
                continue
            order = torch.tensor(key_registers(per_lane, run, mixed))
            codes = regs[:, :, order].view(heads, lanes, per_lane // run, run)
            if bool((codes == codes[..., :1]).all()):
                return run, mixed
    return 1, False


def _group(columns: torch.Tensor) -> int:
    """How many consecutive runs have adjacent index columns, aligned for one load (4, 2 or 1); columns
    [H, L, runs]."""
    runs = columns.shape[2]
    for g in (4, 2):
        if runs % g:
            continue
        c = columns.view(*columns.shape[:2], runs // g, g)
        if bool((c == c[..., :1] + torch.arange(g)).all()) and bool((c[..., 0] % g == 0).all()):
            return g
    return 1


def lane_tables(tables: StepTables, lanes: int = 16) -> LaneTables | None:
    """:class:`LaneTables` of a site's :class:`~loopvq_calib.kernels.decode_inputs.StepTables` for ``lanes``
    lanes per token, or None when the site does not fit this kernel (head dim not a multiple of 2 lanes)."""
    heads, k, d = tables.value.shape
    if lanes not in LANE_CHOICES or d % (2 * lanes):
        return None
    per_lane, pairs = d // lanes, d // (2 * lanes)
    dev = tables.value.device
    slots = torch.arange(d // 2, device=dev).expand(heads, -1)  # slot i: pair i, unless the tables say otherwise
    if tables.key_pairs is not None:
        slots = tables.key_pairs.long()
    a, b = (c.to(dev)[slots].view(heads, lanes, pairs) for c in pair_channels(d, tables.rope_style))
    code_a = tables.key_code_a.view(heads, lanes, pairs)
    code_b = tables.key_code_b.view(heads, lanes, pairs)
    rk, mixed = _key_runs(code_a.cpu(), code_b.cpu(), per_lane)
    order = torch.tensor(key_registers(per_lane, rk, mixed), device=dev)  # register of each run position
    reg_values = torch.cat([tables.key_a.view(heads, k, lanes, pairs), tables.key_b.view(heads, k, lanes, pairs)], 3)
    key = reg_values[..., order].view(heads, k, lanes, per_lane // rk, rk).permute(0, 3, 1, 2, 4)
    reg_codes = torch.cat([code_a, code_b], 2)[..., order].view(heads, lanes, per_lane // rk, rk)
    reg_channel = torch.cat([a, b], 2)  # [H, L, per_lane]

    vorder = _slot_order(tables.value_code)
    vcode = tables.value_code.gather(1, vorder)
    rv = _run(vcode, per_lane)
    value = tables.value.gather(2, vorder[:, None, :].expand(-1, k, -1))
    value = value.view(heads, k, lanes, per_lane // rv, rv).permute(0, 3, 1, 2, 4)
    i32 = torch.int32
    key_column = reg_codes[..., 0].to(i32).contiguous()
    value_column = vcode.view(heads, lanes, per_lane // rv, rv)[..., 0].to(i32).contiguous()
    return LaneTables(
        key.contiguous(),
        value.contiguous(),
        key_column,
        value_column,
        reg_channel.reshape(heads, d).to(i32).contiguous(),
        vorder.to(i32).contiguous(),
        rk,
        mixed,
        rv,
        lanes,
        _group(key_column.cpu()),
        _group(value_column.cpu()),
        tables.key_pairs,
    )
