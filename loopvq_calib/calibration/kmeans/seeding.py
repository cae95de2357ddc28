"""Initial centroids of a batch of k-means problems (:mod:`~loopvq_calib.calibration.kmeans.batch`): weighted
k-means++ (torch, or the fused Triton kernels of :mod:`~loopvq_calib.kernels.kmeans`) and weighted random draws
without replacement, [P, K, G] for the Lloyd iterations of :mod:`~loopvq_calib.calibration.kmeans.solvers`.

Randomness is drawn on the CPU from seeded generators and only indices or uniforms are moved to the
compute device, so a seed gives the same draws on any device and for any ``problems_per_batch``.
"""

from __future__ import annotations

import torch

from ...kernels import kmeans as kmeans_kernels
from ...runtime.streams import to_device
from .batch import CPU_BLOCK, check_shapes, cpu_map


def _draw_one(prob: torch.Tensor, fallback: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row with probability proportional to ``prob`` [P, N] (>= 0), by inverse CDF of the
    uniforms ``u`` [P] (drawn on the CPU by the caller); a row whose total is zero draws from ``fallback``
    (same shape, positive total). Zero-probability entries are never drawn. One float64 prefix sum per
    row: few, large kernels, since the k-means++ draws are sequential and bound by kernel launches on GPU."""
    cdf = prob.cumsum(-1, dtype=torch.float64)
    empty = cdf[:, -1] <= 0
    if empty.any():  # rare: only those rows are redrawn from the fallback (one host sync; the common case skips a pass)
        cdf = torch.where(empty[:, None], fallback.cumsum(-1, dtype=torch.float64), cdf)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    last_positive = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(idx, last_positive).squeeze(1)


def kmeans_pp_init(
    x: torch.Tensor,
    w: torch.Tensor,
    k: int,
    *,
    generator: torch.Generator,
    fused: bool = False,
    trusted_weights: bool = False,
) -> torch.Tensor:
    """Weighted k-means++: the first centroid drawn with probability ~ w, each next one ~ w * D^2
    (D^2: squared distance to the nearest chosen centroid; a problem whose w * D^2 is all zero draws
    ~ w again). x [P, N, G], w [P, N] -> [P, K, G]. ``generator`` is a CPU generator drawing all
    K x P uniforms at once (one transfer to the device); the result is deterministic given its state.

    D^2 to a new centroid is ||x||^2 - 2 x.c + ||c||^2 (one batched matrix-vector product per draw,
    not a pass over an [P, N, G] difference); drawn points are pinned to exactly zero. ``fused``: the
    Triton kernels of :mod:`~loopvq_calib.kernels.kmeans` (same rules and uniforms, D^2 as ||x - c||^2).
    ``trusted_weights``: the caller guarantees w >= 0 with a positive total per problem (as
    :func:`~loopvq_calib.calibration.kmeans.fit.layout_problems` makes them), so nothing waits for the device
    here: the draws queue behind its earlier work."""
    check_shapes(x, w, k, values=not trusted_weights)
    p = x.shape[0]
    uniforms = to_device(torch.rand(k, p, generator=generator, dtype=torch.float64), x.device)
    if fused:
        return kmeans_kernels.kmeans_pp(x.float().contiguous(), w.float().contiguous(), k, uniforms=uniforms)
    if x.device.type != "cpu":
        return _kmeans_pp_rows(x, w, k, uniforms=uniforms)
    blocks = [slice(s, s + CPU_BLOCK) for s in range(0, p, CPU_BLOCK)]
    return torch.cat(cpu_map(lambda b: _kmeans_pp_rows(x[b], w[b], k, uniforms=uniforms[:, b]), blocks))


def _kmeans_pp_rows(x: torch.Tensor, w: torch.Tensor, k: int, *, uniforms: torch.Tensor) -> torch.Tensor:
    """The torch k-means++ draws of :func:`kmeans_pp_init` with the uniforms [K, P] given; rows independent."""
    p, _, g = x.shape
    rows = torch.arange(p, device=x.device)
    x_sq = x.pow(2).sum(-1)
    xt = x.transpose(1, 2).contiguous()  # [P, G, N]: a row-vector product over it is fast on CPU and GPU
    out = x.new_empty(p, k, g)
    chosen = _draw_one(w, w, uniforms[0])
    d2 = torch.full_like(x_sq, float("inf"))
    bias, dist, prob = torch.empty_like(x_sq)[:, None, :], torch.empty_like(x_sq)[:, None, :], torch.empty_like(x_sq)
    for j in range(k):  # buffers reused across the K draws: each draw is a few passes over [P, N]
        out[:, j] = x[rows, chosen]
        c = out[:, j]
        torch.add(x_sq[:, None, :], c.pow(2).sum(-1)[:, None, None], out=bias)
        torch.baddbmm(bias, c[:, None, :], xt, alpha=-2.0, out=dist)
        torch.minimum(d2, dist[:, 0].clamp_min_(0), out=d2)
        d2[rows, chosen] = 0.0
        if j + 1 < k:
            chosen = _draw_one(torch.mul(w, d2, out=prob), w, uniforms[j + 1])
    return out


def random_init(x: torch.Tensor, w: torch.Tensor, k: int, *, generator: torch.Generator) -> torch.Tensor:
    """K distinct points drawn without replacement with probability ~ w (Efraimidis-Spirakis keys
    E/w, E ~ Exp(1)); zero-weight points come last, in index order. x [P, N, G] -> [P, K, G]."""
    check_shapes(x, w, k)
    expo = torch.empty(w.shape, dtype=torch.float32).exponential_(generator=generator).to(x.device)
    keys = torch.where(w > 0, expo / w, torch.full_like(expo, float("inf")))
    idx = keys.sort(dim=-1, stable=True).indices[:, :k]
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


INITS = {"kmeans++": kmeans_pp_init, "random": random_init}
