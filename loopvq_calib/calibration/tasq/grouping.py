"""TaSQ stage: channel weights w, the sigma rule and the permutation P of the key groups (docs/tasq.md).

For every key block (one site for ``tasq``, the T_c steps of one layer for ``tasq+loopvq``), w comes from
the captured query statistic of each site, sigma is :meth:`TasqTransform.sigma`, and P is fitted per KV head
from the covariance of the transformed keys y = x * w / sigma over the block's T*D flat coordinates
(``m * D + channel``): RoPE pairs are merged pairwise, round by round, by a minimum-weight perfect matching
with cost det(Sigma[S,S] + eps I)^(1/|S|), until units hold ``group_size`` coordinates. With
``tasq.grouping: channels`` a unit is one RoPE pair at every step of the block, so each group holds the same
channels at every step (a fixed per-step slice, as LoopVQ, with the channels permuted).
Value layouts pass through unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ...codes.codec import TasqTransform, flatten_block, sigma_bits
from ...codes.layouts import BlockLayout, layout_owner
from ...config.schema import QuantConfig, TasqConfig
from ...config.source import ConfigError
from ...models.common import pair_channels
from ...models.sites import KVLayout
from ...runtime.clock import DeviceClock
from ...runtime.files import write_bytes_atomic, write_tensors_atomic
from ...runtime.processes import SINGLE, DistContext
from ..capture.reader import CaptureData
from .stats import channel_weights

CHUNK_TOKENS = 4096  # tokens per covariance chunk (bounds the transformed copy of a block)
GROUPING_BYTES = 1 << 30  # the first merge round's gathered candidate sets, per batch of heads (CPU)
GPU_GROUPING_BYTES = 4 << 30  # on an accelerator: fewer, larger batches (the matching's loops are host-bound)


@dataclass
class TasqResult:
    """Fitted TaSQ: all layouts (key groups replaced by P), one transform per key layout, a fit report."""

    layouts: list[BlockLayout]
    transforms: dict[str, TasqTransform]
    report: dict

    def save(self, folder: Path) -> None:
        """``tasq.safetensors`` (groups and weights) + ``tasq.json`` (layout fields, sigma_min, report)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"{lay.key}.groups": lay.groups.to(torch.int64).contiguous().cpu() for lay in self.layouts}
        tensors.update({f"{k}.tasq_weight": t.weight.float().contiguous().cpu() for k, t in self.transforms.items()})
        write_tensors_atomic(folder / "tasq.safetensors", tensors)
        meta = {
            "layouts": [lay.to_dict() for lay in self.layouts],
            "transforms": {k: {"sigma_min": t.sigma_min} for k, t in self.transforms.items()},
            "report": self.report,
        }
        write_bytes_atomic(folder / "tasq.json", json.dumps(meta, indent=1).encode())

    @classmethod
    def load(cls, folder: Path) -> TasqResult:
        """Inverse of :meth:`save`."""
        folder = Path(folder)
        meta = json.loads((folder / "tasq.json").read_text())
        tensors = load_file(str(folder / "tasq.safetensors"))
        layouts = [BlockLayout.from_dict(d, tensors[f"{d['kind']}.{d['name']}.groups"]) for d in meta["layouts"]]
        transforms = {
            k: TasqTransform(tensors[f"{k}.tasq_weight"], v["sigma_min"]) for k, v in meta["transforms"].items()
        }
        return cls(layouts, transforms, meta["report"])


def rope_pair_units(head_dim: int, steps: int, rope_style: str) -> torch.Tensor:
    """The RoPE pairs of every step as flat coordinates -> [steps * D/2, 2] (step-major).

    ``half``: {i, i + D/2}; ``interleaved``: {2i, 2i+1}; step m adds m * D.
    """
    half = head_dim // 2
    pair = torch.stack(pair_channels(head_dim, rope_style), -1)
    offsets = torch.arange(steps)[:, None, None] * head_dim
    return (pair[None] + offsets).reshape(steps * half, 2)


def channel_units(head_dim: int, steps: int, rope_style: str) -> torch.Tensor:
    """Each RoPE pair at every step of the block as one unit of flat coordinates -> [D/2, 2 * steps]: merged,
    they give groups of the same channels at every step (c = G / steps coordinates per step)."""
    pair = torch.stack(pair_channels(head_dim, rope_style), -1)  # [D/2, 2]
    offsets = torch.arange(steps)[None, :, None] * head_dim
    return (pair[:, None, :] + offsets).reshape(head_dim // 2, 2 * steps)


def grouping_units(head_dim: int, steps: int, rope_style: str, grouping: str) -> torch.Tensor:
    """The units ``tasq.grouping`` merges: :func:`rope_pair_units` (``free``) or :func:`channel_units`."""
    return (channel_units if grouping == "channels" else rope_pair_units)(head_dim, steps, rope_style)


def _block(m: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """m[rows[..., i], cols[..., j]] -> [..., len(rows), len(cols)]; for a batch m [B, C, C], rows and cols
    lead with B and index their own matrix. (index_select on flat indices: much faster on a busy CPU than
    broadcast advanced indexing.)"""
    c = m.shape[-1]
    flat = rows[..., :, None] * c + cols[..., None, :]
    if m.dim() == 3:
        flat = flat + (torch.arange(m.shape[0], device=m.device) * c * c).view(-1, *[1] * (flat.dim() - 1))
    return m.reshape(-1).index_select(0, flat.reshape(-1)).view(flat.shape)


def set_costs(cov: torch.Tensor, sets: torch.Tensor, eps: float) -> torch.Tensor:
    """det(cov[S,S] + eps I)^(1/|S|) for each row S of ``sets`` [..., P, k] (via slogdet, float64) -> [..., P];
    cov [C, C], or [B, C, C] with sets [B, P, k]."""
    k = sets.shape[-1]
    sub = _block(cov.double(), sets, sets) + eps * torch.eye(k, dtype=torch.float64, device=cov.device)
    return torch.exp(torch.linalg.slogdet(sub).logabsdet / k)


def merge_costs(cov: torch.Tensor, units: torch.Tensor, eps: float) -> torch.Tensor:
    """Symmetric [..., n, n] cost of merging units i and j (rows of ``units`` [..., n, u]); +inf on the
    diagonal. cov [C, C], or [B, C, C] with units [B, n, u]."""
    n = units.shape[-2]
    i, j = torch.triu_indices(n, n, offset=1, device=cov.device)
    cost = torch.full((*units.shape[:-2], n, n), float("inf"), dtype=torch.float64, device=cov.device)
    c = set_costs(cov, torch.cat([units[..., i, :], units[..., j, :]], -1), eps)
    cost[..., i, j] = c
    cost[..., j, i] = c
    return cost


def min_weight_matching(cost: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Perfect matching of n (even) nodes with low total cost: greedy (cheapest available pair first),
    then best-improvement 2-opt (re-pair two matched edges while that lowers the total). -> (a, b) [n/2].
    A batch cost [B, n, n] is matched per matrix, in lockstep (same result as one at a time) -> [B, n/2]."""
    if cost.dim() == 2:
        a, b = min_weight_matching(cost[None])
        return a[0], b[0]
    batch, n, _ = cost.shape
    m, rb = n // 2, torch.arange(batch, device=cost.device)
    free = cost.clone()
    a = torch.empty(batch, m, dtype=torch.long, device=cost.device)
    b = torch.empty(batch, m, dtype=torch.long, device=cost.device)
    for t in range(m):
        flat = free.view(batch, -1).argmin(-1)
        i, j = flat // n, flat % n
        a[:, t], b[:, t] = i, j
        for end in (i, j):
            free[rb, end, :] = float("inf")
            free[rb, :, end] = float("inf")
    cur = cost[rb[:, None], a, b]
    # re-pairing edges k, l as (a_k,a_l) (b_k,b_l) | (a_k,b_l) (b_k,a_l)
    gains = torch.empty(batch, 2, m, m, dtype=cost.dtype, device=cost.device)
    gains[:, 0] = cur[:, :, None] + cur[:, None, :] - (_block(cost, a, a) + _block(cost, b, b))
    gains[:, 1] = cur[:, :, None] + cur[:, None, :] - (_block(cost, a, b) + _block(cost, b, a))
    for _ in range(n * n):
        best_gain, best = gains.view(batch, -1).max(-1)
        h = (best_gain > 1e-12 * cur.sum(-1)).nonzero().flatten()
        if h.numel() == 0:
            break
        kind, rest = best[h] // (m * m), best[h] % (m * m)
        k, l = rest // m, rest % m
        bk, al, bl = b[h, k], a[h, l], b[h, l]
        b[h, k] = torch.where(kind == 0, al, bl)  # a[h, k] stays
        a[h, l], b[h, l] = bk, torch.where(kind == 0, bl, al)
        for e in (k, l):  # only the gains of pairs with a re-paired edge change: same values as recomputing all
            cur[h, e] = cost[h, a[h, e], b[h, e]]
        for e in (k, l):
            _refresh_gains(cost, a, b, cur=cur, gains=gains, h=h, e=e)
    return a, b


def _refresh_gains(
    cost: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    cur: torch.Tensor,
    gains: torch.Tensor,
    h: torch.Tensor,
    e: torch.Tensor,
) -> None:
    """Row and column e[i] of matrix h[i]'s 2-opt gains, by the formulas of the full computation."""
    hc, ae, be, ce = h[:, None], a[h, e][:, None], b[h, e][:, None], cur[h, e][:, None]
    ah, bh, ch = a[h], b[h], cur[h]
    gains[h, 0, e, :] = ce + ch - (cost[hc, ae, ah] + cost[hc, be, bh])
    gains[h, 0, :, e] = ch + ce - (cost[hc, ah, ae] + cost[hc, bh, be])
    gains[h, 1, e, :] = ce + ch - (cost[hc, ae, bh] + cost[hc, be, ah])
    gains[h, 1, :, e] = ch + ce - (cost[hc, ah, be] + cost[hc, bh, ae])


def check_group_size(group_size: int, coords: int, *, unit: int = 2) -> None:
    """TaSQ groups are units of ``unit`` coordinates merged by doubling: G must be unit * 2^k and divide
    ``coords``."""
    multiple = group_size // unit
    if group_size % unit or multiple & (multiple - 1) or coords % group_size:
        what = "RoPE pairs" if unit == 2 else f"RoPE pairs taken at every step ({unit} coordinates)"
        raise ConfigError(
            "quant.group_size",
            f"TaSQ merges {what} by doubling ({unit}, {2 * unit}, {4 * unit}, ...) into groups that split the "
            f"{coords} coordinates of a block; group_size {group_size} is not reachable",
        )


def fit_groups(cov: torch.Tensor, units: torch.Tensor, group_size: int, *, eps: float) -> torch.Tensor:
    """Merge ``units`` [n, u] pairwise by :func:`min_weight_matching` of :func:`merge_costs` until they hold
    ``group_size`` coordinates. -> [n_groups, G], each row sorted, rows ordered by first coordinate. A
    batch cov [B, C, C] (the heads of a block) is fitted at once -> [B, n_groups, G]."""
    check_group_size(group_size, units.numel(), unit=units.shape[-1])
    if cov.dim() == 2:
        return fit_groups(cov[None], units, group_size, eps=eps)[0]
    rb = torch.arange(cov.shape[0], device=cov.device)[:, None]
    units = units.to(cov.device).expand(cov.shape[0], *units.shape)
    while units.shape[-1] < group_size:
        a, b = min_weight_matching(merge_costs(cov, units, eps))
        units = torch.cat([units[rb, a], units[rb, b]], -1)
    units = units.sort(-1).values
    return units.gather(1, units[..., :1].argsort(1).expand_as(units))


def grouping_cost(cov: torch.Tensor, groups: torch.Tensor, eps: float) -> float:
    """Total cost sum_S det(cov[S,S] + eps I)^(1/|S|) of groups [n, G]."""
    return float(set_costs(cov, groups, eps).sum())


def mean_abs_corr(cov: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Mean |correlation| over the distinct coordinate pairs inside each group: cov [..., C, C], groups
    [..., n, G] -> [...]."""
    std = cov.double().diagonal(dim1=-2, dim2=-1).clamp_min(1e-30).sqrt()
    corr = cov.double() / (std[..., :, None] * std[..., None, :])
    sub = _block(corr, groups, groups).abs()
    g = groups.shape[-1]
    off = ~torch.eye(g, dtype=torch.bool, device=cov.device)
    return sub[..., off].mean((-1, -2))


def block_covariance(x: torch.Tensor, transform: TasqTransform) -> torch.Tensor:
    """Per-head covariance (1/N, centred) of y = forward(x, sigma(x)) over flat coordinates:
    x [N, T, H, D] -> [H, T*D, T*D] float64 on x's device. Two passes (mean, then centred products) in
    chunks; each chunk's products are float32, summed in float64."""
    chunks = x.split(CHUNK_TOKENS)
    transform = transform.on(x.device)  # its weights copied once, not at every chunk

    def transformed(part: torch.Tensor) -> torch.Tensor:
        return flatten_block(transform.forward(part.float(), transform.sigma(part)))

    h, td = x.shape[2], x.shape[1] * x.shape[3]
    mean = torch.zeros(h, td, dtype=torch.float64, device=x.device)
    for part in chunks:
        mean += transformed(part).sum(0, dtype=torch.float64)
    mean /= x.shape[0]
    cov = torch.zeros(h, td, td, dtype=torch.float64, device=x.device)
    for part in chunks:
        yc = (transformed(part) - mean.float()).transpose(0, 1)  # [H, n, TD]
        cov += (yc.transpose(1, 2) @ yc).double()
    return cov / x.shape[0]


def heads_per_batch(units: int, budget_bytes: int = GROUPING_BYTES, *, unit_size: int = 2) -> int:
    """Heads whose grouping is fitted together: the first merge round gathers units * (units - 1) / 2
    candidate sets of (2 unit_size)^2 coordinates per head (float64 values and int64 indices)."""
    return max(1, budget_bytes // (units * (units - 1) // 2 * (2 * unit_size) ** 2 * 16))


def fit_tasq(
    reader: CaptureData,
    layouts: list[BlockLayout],
    kv: KVLayout,
    *,
    quant: QuantConfig,
    cfg: TasqConfig,
    dist: DistContext = SINGLE,
    device: torch.device | str | None = None,
) -> TasqResult:
    """Fit w, sigma_min and P for every key layout; value layouts are returned unchanged.

    Keys, covariances and the grouping fit live on ``device`` (default CPU). The heads of all key layouts
    with the same number of steps are fitted together in batches (:func:`heads_per_batch`), which gives the
    groups of one head at a time. Under several processes (``dist``) it fits only the key layouts that
    :func:`~loopvq_calib.codes.layouts.layout_owner` gives this process (as k-means does); the others are
    returned as planned, without a transform, and :func:`merge_tasq` joins the parts."""
    if not quant.uses_tasq:
        raise ValueError(f"fit_tasq called for method {quant.method!r}, which uses no TaSQ transform")
    for lay in layouts:
        if lay.kind == "key":
            unit = 2 * lay.steps if cfg.grouping == "channels" else 2
            check_group_size(quant.group_size, lay.steps * lay.head_dim, unit=unit)
    dev = torch.device(device or "cpu")
    mine = [lay for lay in dist.share(layouts) if lay.kind == "key"]
    transforms, covs, tokens = {}, {}, {}
    seconds = dict.fromkeys(("query_stats", "load", "covariance", "grouping", "report"), 0.0)
    clock = DeviceClock(dev)
    for lay in mine:
        weight = torch.stack([channel_weights(reader.query_stats(s), cfg.weight_floor) for s in lay.sites])
        transforms[lay.key] = TasqTransform(weight, cfg.sigma_min)
        seconds["query_stats"] += clock.lap()
        x = reader.load("key", lay.sites, device=dev)
        seconds["load"] += clock.lap()
        covs[lay.key], tokens[lay.key] = block_covariance(x, transforms[lay.key]), int(x.shape[0])
        seconds["covariance"] += clock.lap()
        del x
    fitted = _fit_all_groups(mine, covs, kv, group_size=quant.group_size, eps=cfg.det_eps, grouping=cfg.grouping)
    seconds["grouping"] += clock.lap()
    new_layouts, blocks = {}, {}
    for lay in mine:
        cov, planned, groups = covs[lay.key], lay.groups.to(dev).expand(kv.kv_heads, -1, -1), fitted[lay.key]
        blocks[lay.key] = {
            "sites": list(lay.sites),
            "tokens": tokens[lay.key],
            "cost_before": set_costs(cov, planned, cfg.det_eps).sum(-1).tolist(),
            "cost_after": set_costs(cov, groups, cfg.det_eps).sum(-1).tolist(),
            "corr_before": mean_abs_corr(cov, planned).tolist(),
            "corr_after": mean_abs_corr(cov, groups).tolist(),
        }
        new_layouts[lay.key] = dataclasses.replace(lay, groups=groups.cpu())
        new_layouts[lay.key].check()
    seconds["report"] += clock.lap()
    report = {
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "method": quant.method,
        "group_size": quant.group_size,
        "grouping": cfg.grouping,
        "det_eps": cfg.det_eps,
        "sigma_bits": sigma_bits(kv.kv_heads, kv.head_dim),
        "blocks": blocks,
    }
    return TasqResult([new_layouts.get(lay.key, lay) for lay in layouts], transforms, report)


def _fit_all_groups(
    layouts: list[BlockLayout],
    covs: dict[str, torch.Tensor],
    kv: KVLayout,
    *,
    group_size: int,
    eps: float,
    grouping: str = "free",
) -> dict[str, torch.Tensor]:
    """:func:`fit_groups` over the heads of all ``layouts``: those with the same steps stacked and fitted in
    batches of :func:`heads_per_batch` heads -> {layout key: groups [H, n_groups, G]}."""
    out: dict[str, torch.Tensor] = {}
    for steps in sorted({lay.steps for lay in layouts}):
        same = [lay for lay in layouts if lay.steps == steps]
        units = grouping_units(kv.head_dim, steps, kv.rope_style, grouping)
        stacked = torch.cat([covs[lay.key] for lay in same])
        budget = GROUPING_BYTES if stacked.device.type == "cpu" else GPU_GROUPING_BYTES
        batch = heads_per_batch(units.shape[0], budget, unit_size=units.shape[1])
        groups = torch.cat([fit_groups(part, units, group_size, eps=eps) for part in stacked.split(batch)])
        out.update(zip((lay.key for lay in same), groups.split(kv.kv_heads)))
    return out


def merge_tasq(parts: list[TasqResult]) -> TasqResult:
    """Join the results of ``fit_tasq`` on processes r = 0 .. len(parts) - 1 of ``len(parts)``."""
    world = len(parts)
    layouts = [parts[layout_owner(i, world)].layouts[i] for i in range(len(parts[0].layouts))]
    transforms = {k: t for part in parts for k, t in part.transforms.items()}
    found = {k: v for part in parts for k, v in part.report["blocks"].items()}
    blocks = {lay.key: found[lay.key] for lay in layouts if lay.key in found}
    return TasqResult(layouts, transforms, {**parts[0].report, "blocks": blocks})
