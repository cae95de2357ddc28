"""Which k-means backend runs (``kmeans.backend``): faiss | torch | triton, or ``auto``, which picks the fused
Triton kernels on a CUDA device where they take the run's codebooks and compile and run there, and the batched
torch backend elsewhere (the kernels' dispatch rule, :mod:`~loopvq_calib.kernels.backends`)."""

from __future__ import annotations

import torch

from ...kernels import kmeans as kmeans_kernels
from ...kernels.backends import DISPATCH, KMEANS_CHOICES, Backend, Candidate


def resolve_backend(
    backend: str, device: torch.device | str, shape: tuple[int, int] | None = None, *, points: int = 0
) -> str:
    """The backend that runs: ``auto`` is the fused Triton kernels on a CUDA device where they take codebooks of
    ``shape`` = (K, G) (:func:`~loopvq_calib.kernels.kmeans.supports`) and their probe, sized by ``points`` per
    problem (:func:`~loopvq_calib.kernels.kmeans.probe`), passes, else the batched torch backend, with a
    warning (once) saying why on a CUDA device; on the CPU it is torch (whose nearest-centroid search there is
    faiss's when installed). On the H200 torch was 16x faster than faiss-cpu on 32 threads
    (docs/performance.md). An explicit backend is taken as asked, or refused (ValueError) where it cannot run."""
    return DISPATCH.choose(
        backend,
        [
            kmeans_kernels.candidate(device, shape, points=points),
            Candidate(Backend.TORCH, "the torch backend"),
            Candidate(Backend.FAISS, "faiss", auto=False),
        ],
        what="kmeans.backend",
        choices=KMEANS_CHOICES,
        device=device,
    ).backend.value
