"""Code-group layouts as data.

A *block* is the set of KV sites coded together (the T_c loop steps of one layer, or one site for
channel-only methods and non-looped layers). Within a block, one KV head's keys (or values) form a
vector of T_c * D coordinates, flat coordinate ``m * D + channel`` for loop step m of the block. A
layout's ``groups`` tensor [H or 1, n_groups, G] lists, for every code, the flat coordinates it covers,
in code order. The groups of one head partition its T_c * D coordinates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config.schema import QuantConfig
from ..models.common import pair_channels
from ..models.sites import KVLayout

KINDS = ("key", "value")


def layout_owner(index: int, world: int) -> int:
    """The process that fits layout ``index`` of a plan when ``world`` processes share the layouts (TaSQ and
    k-means give each process the same ones, so a process reads only its layouts' capture tensors)."""
    return index % world


@dataclass
class BlockLayout:
    """Where each code's coordinates come from, for one block and one kind (key or value)."""

    name: str  # block name: "b{block}.l{layer}" for loop blocks, "prelude.l{i}" / "coda.l{i}" otherwise
    kind: str
    sites: tuple[int, ...]  # KV site ids in loop-step order
    head_dim: int
    kv_heads: int
    groups: torch.Tensor  # [1 or kv_heads, n_groups, G] int64 flat coordinates

    @property
    def steps(self) -> int:
        """Sites (loop steps) of the block."""
        return len(self.sites)

    @property
    def group_size(self) -> int:
        """G, the coordinates of one code."""
        return self.groups.shape[-1]

    @property
    def num_groups(self) -> int:
        """Codes per head and token."""
        return self.groups.shape[-2]

    @property
    def key(self) -> str:
        """Unique name of this (kind, block) pair, used for tensor names."""
        return f"{self.kind}.{self.name}"

    def to_dict(self) -> dict:
        """Every field but the groups tensor (stored apart, under ``{key}.groups``); :meth:`from_dict` inverts it."""
        return {
            "name": self.name,
            "kind": self.kind,
            "sites": list(self.sites),
            "head_dim": self.head_dim,
            "kv_heads": self.kv_heads,
        }

    @classmethod
    def from_dict(cls, d: dict, groups: torch.Tensor) -> BlockLayout:
        """The layout :meth:`to_dict` described, with its ``groups`` tensor."""
        return cls(d["name"], d["kind"], tuple(d["sites"]), d["head_dim"], d["kv_heads"], groups)

    def check(self) -> None:
        """Each head's groups must partition the block's coordinates exactly once."""
        total = self.steps * self.head_dim
        for h in range(self.groups.shape[0]):
            flat = self.groups[h].flatten().sort().values
            if flat.numel() != total or not torch.equal(flat, torch.arange(total)):
                raise ValueError(
                    f"layout {self.key} head {h}: groups do not cover the {total} coordinates exactly once"
                )


def channel_groups(head_dim: int, group_size: int) -> torch.Tensor:
    """CQ: G consecutive channels of one step -> [D/G, G]."""
    if head_dim % group_size:
        raise ValueError(f"head_dim {head_dim} is not divisible by group size {group_size}")
    return torch.arange(head_dim).view(head_dim // group_size, group_size)


def loop_axis_groups(head_dim: int, steps: int, group_size: int) -> torch.Tensor:
    """LoopVQ: c = G / T_c channels in each of the T_c steps; joint coordinate i*T_c + m holds
    (channel i of the group, step m) -> flat m*D + (g*c + i). Returns [D/c, G]."""
    if group_size % steps:
        raise ValueError(f"group size {group_size} is not divisible by {steps} steps per block")
    c = group_size // steps
    if head_dim % c:
        raise ValueError(f"head_dim {head_dim} is not divisible by c = {c} channels per step")
    g = torch.arange(head_dim // c)[:, None, None]
    i = torch.arange(c)[None, :, None]
    m = torch.arange(steps)[None, None, :]
    return (m * head_dim + g * c + i).reshape(head_dim // c, group_size)


# the default groups of a block of several loop steps, by the name a method's ``loop_layout`` gives:
# (head_dim, steps, group_size) -> [n_groups, G] flat coordinates
LOOP_LAYOUTS: dict[str, Callable[[int, int, int], torch.Tensor]] = {"loop-axis": loop_axis_groups}


def plan_layouts(kv: KVLayout, quant: QuantConfig) -> list[BlockLayout]:
    """The default layouts of a method, for keys and values of every block.

    Loop-axis methods group looped sites in blocks of T_c steps by their ``loop_layout`` rule
    (:data:`LOOP_LAYOUTS`); non-looped sites (Huginn prelude and coda) and channel-only methods use CQ groups. TaSQ
    methods later replace the key groups with the permutation fitted by the TaSQ stage
    (:mod:`loopvq_calib.calibration.tasq.grouping`).
    """
    loop_groups = LOOP_LAYOUTS[quant.declaration.loop_layout] if quant.loop_axis else None
    out = []
    for block in kv.blocks(quant.block_steps):
        if block.steps > 1:
            groups = loop_groups(kv.head_dim, block.steps, quant.group_size)
        else:
            groups = channel_groups(kv.head_dim, quant.group_size)
        sites = tuple(s.site for s in block.sites)
        for kind in KINDS:
            out.append(BlockLayout(block.name, kind, sites, kv.head_dim, kv.kv_heads, groups[None].clone()))
    return out


def channel_sets(layout: BlockLayout, rope_style: str) -> torch.Tensor | None:
    """The channels of every code when ``layout`` is a *channels* layout, else None.

    A channels layout (``tasq.grouping: channels``): each code holds the same c = G / T channels at every step
    of the block (c coordinates of each step, the same channel set at each), and those channels are whole RoPE
    pairs of ``rope_style`` (``half``: i with i + D/2, ``interleaved``: 2i with 2i + 1). Step m's slice of a code is
    then a fixed set of channels, as in the loop-axis layout, so a decoder may permute channels once instead of
    gathering them per coordinate. Returns [Hg, n, c] int64, each row sorted; positions inside a codeword are
    free (read ``groups`` for them). The one test of the property: serving, the bundle writer and the reader
    use it."""
    d, t, g = layout.head_dim, layout.steps, layout.group_size
    if g % t:
        return None
    coords = layout.groups.detach().cpu().long().sort(-1).values  # ascending: step 0's coordinates first
    per_step = coords.view(*coords.shape[:2], t, g // t)
    if not bool((per_step // d == torch.arange(t)[:, None]).all()):
        return None
    channels = per_step % d
    if not bool((channels == channels[:, :, :1]).all()):
        return None
    sets = channels[:, :, 0]
    a, b = pair_channels(d, rope_style)
    partner = torch.empty(d, dtype=torch.long)
    partner[a], partner[b] = b, a
    return sets if torch.equal(partner[sets].sort(-1).values, sets) else None


def codebook_shape(layout: BlockLayout, codebook_size: int, sharing: str) -> tuple[int, int, int, int]:
    """[heads or 1, groups or 1, K, G] for the codebook sharing mode (none | heads | groups | all)."""
    heads = 1 if sharing in ("heads", "all") else layout.kv_heads
    groups = 1 if sharing in ("groups", "all") else layout.num_groups
    return heads, groups, codebook_size, layout.group_size


def points_per_codebook(layout: BlockLayout, tokens: int, sharing: str) -> int:
    """Group vectors one codebook of ``layout`` is fitted on, from ``tokens`` calibration tokens (sinks
    excluded): a shared axis pools its heads or groups."""
    heads, groups, _, _ = codebook_shape(layout, 1, sharing)
    return tokens * (layout.kv_heads // heads) * (layout.num_groups // groups)
