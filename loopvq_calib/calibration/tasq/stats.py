"""What TaSQ needs from the model, gathered at capture time: the query statistic of every site, the channel
weights w derived from it, and the keys' Fisher reduced to what TaSQ's k-means uses (docs/tasq.md).

A TaSQ key group is a union of whole RoPE pairs and its k-means weight is sigma^2 * sum_i F_i / w_i^2 over
its coordinates, so storing F / w^2 summed per RoPE pair keeps every group's weight exact whatever grouping
the TaSQ stage fits later. w needs the query statistics of all sequences, so a forward-only pass collects
them before the capture's forward + backward (:func:`query_statistics`).
"""

from __future__ import annotations

import torch

from ...codes.objective import shared_initial_state
from ...models.common import rope_angles, rope_factors, rotate
from ...models.sites import KVLayout, query_observer
from ...runtime.processes import SINGLE, DistContext


class QueryStats:
    """Per sequence, site and KV head: the sum over causal pairs (i >= j) of diag(R_j^T q_i q_i^T R_j)
    for the post-RoPE query q_i and the RoPE rotation R_j at the key position (GQA query heads averaged).
    Prefix sums over j make it O(S) per site. What depends on the positions alone (the rotation and the
    prefix sums) is computed once per forward, not once per site. The sums stay on the queries' device (a copy
    to the host per site would stop the forward at every site); :meth:`on_host` moves them all at once."""

    def __init__(self, kv: KVLayout) -> None:
        self.kv = kv
        self.sums: dict[int, torch.Tensor] = {}  # site -> [B, H_kv, D]
        self._positions: torch.Tensor | None = None  # the forward's positions the terms below belong to
        self._terms: tuple[torch.Tensor, ...] = ()

    def _position_terms(self, positions: torch.Tensor, d: int) -> tuple[torch.Tensor, ...]:
        """RoPE factors (fp32) and the prefix sums of cos^2, sin^2 and 2 cos sin over key positions."""
        if self._positions is not positions:  # a new forward; held, so its identity cannot be reused meanwhile
            cos, sin = rope_angles(positions, d, self.kv.rope_theta)
            factors = rope_factors(cos, sin, self.kv.rope_style, dtype=torch.float32)
            c2, s2, cs = (t.cumsum(1)[:, :, None, :] for t in (cos * cos, sin * sin, cos * sin))
            self._positions, self._terms = positions, (factors, c2, s2, 2 * cs)
        return self._terms

    def __call__(self, site: int, q: torch.Tensor, positions: torch.Tensor) -> None:
        kv = self.kv
        with torch.no_grad():
            b, s, hq, d = q.shape
            factors, c2, s2, cs2 = self._position_terms(positions, d)
            qr = rotate(q.float(), factors, kv.rope_style)  # post-RoPE queries
            if kv.rope_style == "half":
                qa, qb = qr[..., : d // 2], qr[..., d // 2 :]
            else:
                qa, qb = qr[..., 0::2], qr[..., 1::2]
            da = (c2 * qa * qa + s2 * qb * qb + cs2 * qa * qb).sum(dim=1)  # [B, Hq, D/2]
            db = (c2 * qb * qb + s2 * qa * qa - cs2 * qa * qb).sum(dim=1)
            diag = torch.cat([da, db], -1) if kv.rope_style == "half" else torch.stack([da, db], -1).flatten(-2)
            self.sums[site] = diag.view(b, kv.kv_heads, hq // kv.kv_heads, d).mean(2)

    def on_host(self) -> dict[int, torch.Tensor]:
        """Every site's sums [B, H_kv, D] on the CPU, in one copy."""
        if not self.sums:
            return {}
        host = torch.stack(list(self.sums.values())).cpu()
        return dict(zip(self.sums, host.unbind(0)))


def channel_weights(diag: torch.Tensor, floor: float) -> torch.Tensor:
    """Query statistic diag [H, D] -> w [H, D]: diag floored at ``floor`` * max per head, then
    w = sqrt(diag / mean(diag)), so that mean(w^2) = 1 per head."""
    d = diag.double()
    top = d.amax(-1, keepdim=True)
    if not (torch.isfinite(d).all() and (top > 0).all()):
        raise ValueError("query statistic is non-finite or zero for a whole head; cannot derive TaSQ weights")
    d = torch.maximum(d, floor * top)
    return (d / d.mean(-1, keepdim=True)).sqrt().float()


def pairs_per_sequence(sequence_length: int) -> float:
    """Causal (i >= j) position pairs of one sequence: the query statistic's normaliser."""
    return sequence_length * (sequence_length + 1) / 2


def query_statistics(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    kv: KVLayout,
    *,
    mine: list[int],
    batch_size: int,
    dist: DistContext = SINGLE,
) -> dict[int, dict[int, torch.Tensor]]:
    """Forward-only pass over the sequences ``mine`` -> per sequence (all of them when the processes
    of ``dist`` each passed theirs: exchanged by an all-reduce of zero-padded sums, which adds only zeros) the query
    statistic of every site [H, D] fp32 on the CPU."""
    device = next(model.parameters()).device
    n = input_ids.shape[0]
    stats = torch.zeros(n, kv.num_sites, kv.kv_heads, kv.head_dim)
    for start in range(0, len(mine), batch_size):
        batch = mine[start : start + batch_size]
        observer = QueryStats(kv)
        with query_observer(model, observer), torch.no_grad(), shared_initial_state(model):  # the capture's state
            model(input_ids[batch].to(device), use_cache=False)
        sums = observer.on_host()
        for i, site in enumerate(s.site for s in kv.sites):
            stats[batch, i] = sums[site]
    if dist.world > 1:
        stats = dist.all_reduce_sum(stats.to(dist.transfer_device())).cpu()
    return {seq: {s.site: stats[seq, i] for i, s in enumerate(kv.sites)} for seq in range(n)}


def mean_query_stat(per_sequence: list[torch.Tensor], pairs: int, sequences: int) -> torch.Tensor:
    """The query statistic averaged over causal pairs and sequences: the per-sequence sums added in sequence
    order, over ``pairs`` x ``sequences`` (the capture reader and :func:`key_weights` both use it)."""
    return sum(per_sequence) / (pairs * sequences)


def key_weights(
    stats: dict[int, dict[int, torch.Tensor]], kv: KVLayout, sequence_length: int, *, floor: float, device: torch.device
) -> dict[int, torch.Tensor]:
    """w [H, D] of every site from the per-sequence statistics, averaged by :func:`mean_query_stat` as
    :meth:`~loopvq_calib.calibration.capture.reader.CaptureData.query_stats` does, so the TaSQ stage derives the
    same w."""
    n = len(stats)
    out = {}
    for s in kv.sites:
        mean = mean_query_stat([stats[seq][s.site] for seq in range(n)], pairs_per_sequence(sequence_length), n)
        out[s.site] = channel_weights(mean, floor).to(device)
    return out


def pair_sum(f: torch.Tensor, rope_style: str) -> torch.Tensor:
    """[..., D] -> [..., D/2]: the two coordinates of each RoPE pair added (half: i, i + D/2; interleaved:
    2i, 2i + 1)."""
    d = f.shape[-1]
    return f[..., : d // 2] + f[..., d // 2 :] if rope_style == "half" else f[..., 0::2] + f[..., 1::2]


def pair_spread(p: torch.Tensor, rope_style: str) -> torch.Tensor:
    """Inverse layout of :func:`pair_sum`: each pair's sum split evenly over its two coordinates -> [..., D]."""
    half = p / 2
    return torch.cat([half, half], -1) if rope_style == "half" else half.repeat_interleave(2, dim=-1)
