"""A batch of independent k-means problems as seeding and Lloyd take it: points x [P, N, G] (float32) and
non-negative weights w [P, N], their shapes checked; on the CPU, the problems spread over threads
(:func:`cpu_map`), faiss's OpenMP held to one thread in each when faiss is installed."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

import torch

CPU_BLOCK = 8  # problems per task on the CPU: a block's points (8 x 8,064 x 16 fp32 = 4 MB) stay in cache


def cpu_map(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[fn(i) for i in items]`` on the CPU, the items spread over ``torch.get_num_threads()`` threads that
    each run single-threaded torch and faiss. The k-means problems are small and independent, so whole
    problems per thread beat splitting each small op across threads (whose OpenMP teams, torch's and
    faiss's separate ones, synchronise thousands of times a second and spin on a busy machine;
    docs/performance.md). Results are those of the sequential loop, in order."""
    threads = torch.get_num_threads()
    workers = min(threads, len(items))
    if workers <= 1:
        return [fn(i) for i in items]
    faiss = faiss_module()

    def run(item: Any) -> Any:
        if faiss is not None:
            faiss.omp_set_num_threads(1)  # this thread's OpenMP setting in faiss's own runtime
        return fn(item)

    torch.set_num_threads(1)  # new threads take this value at their first parallel op
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="loopvq-kmeans") as pool:
            return list(pool.map(run, items))
    finally:
        torch.set_num_threads(threads)


def check_shapes(x: torch.Tensor, w: torch.Tensor, k: int, *, values: bool = True) -> None:
    """Shapes always; the weights' values too unless ``values`` is False (that check waits for the device)."""
    if x.dim() != 3 or w.shape != x.shape[:2]:
        raise ValueError(f"expected points [P, N, G] and weights [P, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] < k:
        raise ValueError(f"{x.shape[1]} points per problem cannot seed {k} distinct centroids")
    if values and ((w < 0).any() or not (w.sum(-1) > 0).all()):
        raise ValueError("weights must be >= 0 with a positive total in every problem")


@lru_cache(maxsize=1)
def faiss_module() -> Any:
    """The faiss module, or None when faiss is not installed (imported once)."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss
