"""Batched weighted k-means: Lloyd iterations (torch, the fused Triton kernels of
:mod:`~loopvq_calib.kernels.kmeans`, or faiss) from initial centroids (k-means++ / random:
:mod:`~loopvq_calib.calibration.kmeans.seeding`).

A batch (:mod:`~loopvq_calib.calibration.kmeans.batch`) holds P independent problems of the same size: points
x [P, N, G] (float32), non-negative weights w [P, N] and initial centroids [P, K, G]. Every backend minimises the
weighted objective sum_n w_n ||x_n - c_a(n)||^2 / sum_n w_n, which we compute ourselves for all (faiss's ``obj``
is unweighted). docs/kmeans.md records the rules and the decisions behind them.

Randomness is drawn on the CPU from seeded generators and only indices or uniforms are moved to the
compute device, so a seed gives the same draws on any device and for any ``problems_per_batch``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...config.schema import KMeansConfig
from ...kernels import kmeans as kmeans_kernels
from ...kernels.backends import DISPATCH
from .batch import CPU_BLOCK, check_shapes, cpu_map, faiss_module
from .select import resolve_backend

__all__ = ["resolve_backend", "weighted_kmeans", "KMeansResult"]


@dataclass
class KMeansResult:
    """Centroids [P, K, G]; weighted objectives [P] at the initial and the final centroids; Lloyd
    updates run [P]; empty clusters met [P] (torch, triton: reseeded; faiss: split)."""

    centroids: torch.Tensor
    objective_init: torch.Tensor
    objective_final: torch.Tensor
    iterations: torch.Tensor
    empty_clusters: torch.Tensor


def mix_seed(*parts: int) -> int:
    """A 31-bit seed derived from integers (numpy SeedSequence), stable across runs and platforms."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0]) & 0x7FFFFFFF


def batch_sizes(cfg: KMeansConfig, device: torch.device | str) -> tuple[int, int]:
    """(problems per batch, points per distance chunk): the config's, or by device when null (GPU: large
    batches; CPU: blocks that stay in cache)."""
    cuda = torch.device(device).type == "cuda"
    return cfg.problems_per_batch or (512 if cuda else CPU_BLOCK), cfg.points_per_chunk or (16384 if cuda else 512)


def weighted_objective(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *, chunk: int) -> torch.Tensor:
    """sum_n w_n min_r ||x_n - c_r||^2 / sum_n w_n per problem -> [P]."""
    return _assign(x, x.pow(2).sum(-1), w, c=c, chunk=chunk, accumulate=False)[0] / w.sum(-1)


def _assign(
    x: torch.Tensor, x_sq: torch.Tensor, w: torch.Tensor, *, c: torch.Tensor, chunk: int, accumulate: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Nearest centroid of every point, ``chunk`` points per problem at a time. Returns the weighted
    squared error [P] and, when ``accumulate``, per-cluster weighted sums [P, K, G] and weights [P, K]."""
    p, n, g = x.shape
    k = c.shape[1]
    err = x.new_zeros(p)
    sums = x.new_zeros(p * k, g) if accumulate else None
    mass = x.new_zeros(p * k) if accumulate else None
    offset = torch.arange(p, device=x.device)[:, None] * k
    search = _faiss_search() if x.device.type == "cpu" else None
    if search is not None:
        chunk = n  # one exact search per problem
    else:
        c_sq = c.pow(2).sum(-1).unsqueeze(1)
        ct = c.transpose(1, 2)
    for s in range(0, n, chunk):
        xc, wc = x[:, s : s + chunk], w[:, s : s + chunk]
        if search is not None:
            d2, nearest = search(xc, c)
        else:
            dmin, nearest = torch.baddbmm(c_sq, xc, ct, alpha=-2).min(-1)
            d2 = dmin + x_sq[:, s : s + chunk]
        err += (d2.clamp_min(0) * wc).sum(-1)
        if accumulate:
            flat = (nearest + offset).flatten()
            sums.index_add_(0, flat, (xc * wc[..., None]).reshape(-1, g))
            mass.index_add_(0, flat, wc.flatten())
    if not accumulate:
        return err, None, None
    return err, sums.view(p, k, g), mass.view(p, k)


def _faiss_search() -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
    """On the CPU the nearest-centroid search of the torch backend is faiss's exact search when faiss is
    installed (``faiss.knn``: the same ||x||^2 - 2 x.c + ||c||^2 distances through BLAS, blocked so they
    stay in cache; 3.5x faster than the chunked ``baddbmm`` on one core of the 2-core CI machine,
    docs/performance.md); the Lloyd rules around it are unchanged. None without faiss."""
    faiss = faiss_module()
    if faiss is None:
        return None

    def search(x: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d2 = torch.empty(x.shape[:2])
        nearest = torch.empty(x.shape[:2], dtype=torch.long)
        for q in range(x.shape[0]):
            dist, idx = faiss.knn(x[q].contiguous().numpy(), c[q].contiguous().numpy(), 1)
            d2[q], nearest[q] = torch.from_numpy(dist[:, 0]), torch.from_numpy(idx[:, 0])
        return d2, nearest

    return search


def _reseed(
    c: torch.Tensor,
    empty: torch.Tensor,
    x: torch.Tensor,
    *,
    w: torch.Tensor,
    rows: list[int],
    keys: list[tuple[int, ...]],
) -> None:
    """Move each empty centroid of row q of ``c`` (problem ``rows[q]`` of x, w) onto a distinct point of
    positive weight, drawn uniformly by a generator seeded from ``keys[q]`` (seed, problem, iteration)."""
    for q in empty.any(-1).nonzero().flatten().tolist():
        slots = empty[q].nonzero().flatten()
        candidates = (w[rows[q]] > 0).nonzero().flatten().cpu()
        gen = torch.Generator().manual_seed(mix_seed(*keys[q]))
        pick = candidates[torch.randperm(candidates.numel(), generator=gen)[: slots.numel()]]
        c[q, slots[: pick.numel()]] = x[rows[q], pick.to(x.device)]


def _lloyd(
    x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, *, cfg: KMeansConfig, keys: list[tuple[int, int]], fused: bool
) -> KMeansResult:
    """Lloyd on one batch of problems, all on x's device; converged problems drop out of the batch.
    ``keys``: per problem the (seed, problem index) its empty-cluster reseeding draws from.
    ``fused``: each step is one Triton kernel over the active problems
    (:func:`~loopvq_calib.kernels.kmeans.lloyd_step`), else the chunked torch assignment over copies of the
    active problems."""
    p = x.shape[0]
    chunk = batch_sizes(cfg, x.device)[1]
    x_sq = None if fused else x.pow(2).sum(-1)

    def step(
        active: torch.Tensor, ca: torch.Tensor, accumulate: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if fused:
            return kmeans_kernels.lloyd_step(x, w, ca, rows=active, accumulate=accumulate)
        part = [t.index_select(0, active) for t in (x, x_sq, w)] if active.numel() < p else [x, x_sq, w]
        return _assign(*part, c=ca, chunk=chunk, accumulate=accumulate)

    total = w.sum(-1)
    iterations = torch.zeros(p, dtype=torch.long)
    empties = torch.zeros(p, dtype=torch.long)
    active = torch.arange(p, device=x.device)
    objective_init = None
    for it in range(cfg.iterations):
        ca = c.index_select(0, active) if active.numel() < p else c
        err, sums, mass = step(active, ca, True)
        if it == 0:
            objective_init = err / total
        new = torch.where(mass[..., None] > 0, sums / mass.clamp_min(torch.finfo(mass.dtype).tiny)[..., None], ca)
        empty = mass <= 0
        if empty.any():
            rows = active.tolist()
            _reseed(new, empty, x, w=w, rows=rows, keys=[(*keys[q], it) for q in rows])
            empties.index_add_(0, active.cpu(), empty.sum(-1).cpu())
        change = (new - ca).abs().mean(dim=(-1, -2))
        c = c.index_copy(0, active, new)
        iterations[active.cpu()] += 1
        active = active[change >= cfg.tolerance]
        if active.numel() == 0:
            break
    objective_final = step(torch.arange(p, device=x.device), c, False)[0] / total
    return KMeansResult(c, objective_init, objective_final, iterations, empties)


def _import_faiss() -> Any:
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "kmeans.backend: 'faiss' needs the faiss package (pip install faiss-cpu); "
            "set kmeans.backend to 'torch' or 'auto' to run without it"
        ) from err
    return faiss


def _faiss_kmeans(
    x: torch.Tensor, w: torch.Tensor, init: torch.Tensor, *, cfg: KMeansConfig, seed: int, device: torch.device
) -> KMeansResult:
    """One faiss.Kmeans per problem: exactly ``cfg.iterations`` updates (faiss has no tolerance stop),
    never subsampled, empty clusters split by faiss. On faiss's GPUs only when ``device`` is a CUDA device
    (``kmeans.device``) and faiss was built with GPU support, else on the CPU (logged for a CUDA device)."""
    faiss = _import_faiss()
    gpu = device.type == "cuda" and faiss.get_num_gpus() > 0
    if device.type == "cuda" and not gpu:
        DISPATCH.warn_once(
            f"kmeans.backend faiss: this faiss has no GPU support (faiss-cpu); k-means runs on the CPU, not {device}"
        )
    p, n, g = x.shape
    k = init.shape[1]
    xs, ws, cs = (t.detach().cpu().float().numpy() for t in (x, w, init))
    centroids = np.empty_like(cs)
    empties = torch.zeros(p, dtype=torch.long)
    for q in range(p):
        km = faiss.Kmeans(
            g,
            k,
            niter=cfg.iterations,
            seed=(seed + q) % 2**31,
            max_points_per_centroid=-(-n // k),
            min_points_per_centroid=1,
            gpu=gpu,
            verbose=False,
        )
        km.train(
            np.ascontiguousarray(xs[q]), weights=np.ascontiguousarray(ws[q]), init_centroids=np.ascontiguousarray(cs[q])
        )
        centroids[q] = km.centroids
        empties[q] = sum(int(s["nsplit"]) for s in km.iteration_stats)
    c = torch.from_numpy(centroids)
    xc, wc = x.detach().cpu().float(), w.detach().cpu().float()
    return KMeansResult(
        c,
        weighted_objective(xc, wc, init.detach().cpu().float(), chunk=batch_sizes(cfg, "cpu")[1]),
        weighted_objective(xc, wc, c, chunk=batch_sizes(cfg, "cpu")[1]),
        torch.full((p,), cfg.iterations),
        empties,
    )


def weighted_kmeans(
    x: torch.Tensor,
    w: torch.Tensor,
    init: torch.Tensor,
    *,
    cfg: KMeansConfig,
    backend: str,
    device: torch.device | str,
    seed: int | None = None,
    problem_keys: list[tuple[int, int]] | None = None,
) -> KMeansResult:
    """Weighted Lloyd from ``init`` [P, K, G] on points x [P, N, G] with weights w [P, N].

    ``backend``: faiss | torch | triton | auto (:func:`resolve_backend`). torch and triton run
    ``cfg.problems_per_batch`` problems at once on ``device`` and stop a problem when the mean absolute
    centroid change falls below ``cfg.tolerance``. ``seed`` (default ``cfg.seed``) drives empty-cluster
    reseeding (torch, triton) and faiss's own generator. Results are on the CPU.
    ``problem_keys``: per problem, the (seed, index) of its reseeding draws (default ``(seed, p)`` for problem
    p), so that problems of several layouts solved together draw what each would draw alone. The fused
    Triton path takes every problem in one batch (it holds no distance block, and each batch pays the host
    cost of its Lloyd loop; ``problems_per_batch`` is the torch backend's).
    """
    name = resolve_backend(backend, device, (init.shape[1], init.shape[2]))
    check_shapes(x, w, init.shape[1])
    if init.shape[0] != x.shape[0] or init.shape[2] != x.shape[2]:
        raise ValueError(f"initial centroids {tuple(init.shape)} do not fit points {tuple(x.shape)}")
    seed = cfg.seed if seed is None else seed
    device = torch.device(device)
    if name == "faiss":
        return _faiss_kmeans(x, w, init, cfg=cfg, seed=seed, device=device)
    keys = problem_keys if problem_keys is not None else [(seed, q) for q in range(x.shape[0])]
    if len(keys) != x.shape[0]:
        raise ValueError(f"{len(keys)} problem keys for {x.shape[0]} problems")
    per_batch = x.shape[0] if name == "triton" else batch_sizes(cfg, device)[0]

    def solve(s: int) -> list[torch.Tensor]:
        sl = slice(s, s + per_batch)
        xb, wb, cb = (t[sl].to(device=device, dtype=torch.float32) for t in (x, w, init))
        r = _lloyd(xb.contiguous(), wb.contiguous(), cb.clone(), cfg=cfg, keys=keys[sl], fused=name == "triton")
        return [r.centroids.cpu(), r.objective_init.cpu(), r.objective_final.cpu(), r.iterations, r.empty_clusters]

    starts = list(range(0, x.shape[0], per_batch))
    parts = cpu_map(solve, starts) if device.type == "cpu" else [solve(s) for s in starts]
    return KMeansResult(*(torch.cat(col) for col in zip(*parts)))
