"""Which k-means backend runs (``kmeans.backend``): faiss | torch | triton, or ``auto``, which picks the fused
Triton kernels on a CUDA device where they compile and run and the batched torch backend elsewhere."""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from ...kernels import kmeans as kmeans_triton

BACKENDS = ("auto", "faiss", "torch", "triton")
log = logging.getLogger("loopvq_calib")


def resolve_backend(backend: str, device: torch.device | str, shape: tuple[int, int] | None = None,
                    *, points: int = 0) -> str:
    """``auto`` is the fused Triton kernels on a CUDA device with triton installed where they compile and
    run, for codebooks of ``shape`` = (K, G) the kernels take (:func:`kmeans_triton.supports`), else the
    batched torch backend, with a warning (once) saying why on a CUDA device; on the CPU it is torch (whose
    nearest-centroid search there is faiss's when installed, ``kmeans_backends._faiss_search``). On the H200 torch was
    16x faster than faiss-cpu on 32 threads (docs/performance.md). ``points``: points per problem, the
    shape the kernels' probe compiles for (:func:`kmeans_triton.works`)."""
    if backend not in BACKENDS:
        raise ValueError(f"kmeans.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    fits = shape is None or kmeans_triton.supports(*shape)
    if backend == "auto":
        if torch.device(device).type != "cuda":
            return "torch"
        why = _triton_unusable(device, shape, fits, points=points)
        if why:
            warn_once(f"kmeans.backend auto: using the torch backend on {device}, not the fused Triton kernels: {why}")
        return "torch" if why else "triton"
    if backend == "triton" and not kmeans_triton.available(device):
        raise ValueError(
            f"kmeans.backend: 'triton' needs the triton package and a CUDA device of compute capability 8.0 or newer, "
            f"not {device}; use 'auto' or 'torch'"
        )
    if backend == "triton" and not fits:
        raise ValueError(
            f"kmeans.backend: 'triton' takes codebooks of at most {kmeans_triton.CODEBOOK_TILE} entries x dimensions "
            f"(each rounded up to a power of two >= 16); quant.codebook_size {shape[0]} x group size {shape[1]} "
            "is larger; use 'auto' or 'torch'"
        )
    return backend


def _triton_unusable(device: torch.device | str, shape: tuple[int, int] | None, fits: bool, *, points: int = 0) -> str:
    """Why the fused kernels cannot fit codebooks of ``shape`` on the CUDA ``device`` ('' when they can)."""
    if kmeans_triton.triton is None:
        return "the triton package is not installed"
    if not kmeans_triton.available(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"compute capability {major}.{minor} is below 8.0 (the kernels' TF32 dot)"
    if not fits:
        return (f"quant.codebook_size {shape[0]} x group size {shape[1]} exceeds the kernels' codebook tile of "
                f"{kmeans_triton.CODEBOOK_TILE} entries x dimensions")
    if not kmeans_triton.works(str(device), *(shape or (16, 16)), n=points):
        return "the kernels do not compile or run there (warning above)"
    return ""


@lru_cache(maxsize=None)
def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time only (k-means backend notes that every layout would repeat)."""
    log.warning(message)
