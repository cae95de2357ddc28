"""First-use costs of a fresh machine, paid off the critical path, on one background thread: the command's first
CUDA work (:func:`warm_device`: context, cuBLAS, attention kernels) while it still imports its libraries; then,
from when the pipeline has checked its inputs, while the model loads and the capture runs, the fused k-means
kernels' probe (Triton compiles every variant the k-means stage launches, seconds on an empty kernel cache), the
fused codec kernels fine-tuning's student launches first (nearest codeword, codeword lookup) and the device's
dense linear algebra (torch loads its CUDA linear-algebra library and cuSOLVER at the first call, seconds from a
cold disk). The stage that needs a job waits for it first (:meth:`Warmup.wait`); a job's error is raised there,
so nothing is lost (docs/decisions.md, "Device warm-up in the background")."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .devices import indexed_device

__all__ = ["Warmup", "warm_device", "warm_linalg"]


class Warmup:
    """Jobs run one after another, in the order submitted, on one background thread (created at the first
    submit: a run with nothing to warm starts no thread)."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._jobs: dict[str, Future] = {}
        self._ran: dict[str, float] = {}
        self.waited: dict[str, float] = {}

    def submit(
        self, name: str, device: torch.device | str | None, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> None:
        """Run ``fn(*args, **kwargs)`` in the background with ``device`` as the thread's current CUDA device (None:
        as it is; a CUDA device without an index: the submitting thread's current one)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopvq-warmup")
        where = indexed_device(device) if device is not None else None
        self._jobs[name] = self._pool.submit(self._timed, name, where, lambda: fn(*args, **kwargs))

    def _timed(self, name: str, device: torch.device | None, job: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            if device is not None and device.type == "cuda":
                with torch.cuda.device(device):
                    return job()
            return job()
        finally:
            self._ran[name] = round(time.perf_counter() - start, 3)

    def wait(self, name: str) -> Any:
        """Job ``name``'s result once it has finished (None when no such job was submitted); its error is raised
        here. The seconds spent waiting are kept in :attr:`waited`."""
        job = self._jobs.pop(name, None)
        if job is None:
            return None
        start = time.perf_counter()
        try:
            return job.result()
        finally:
            self.waited[name] = round(time.perf_counter() - start, 3)

    def report(self) -> dict[str, dict[str, float]]:
        """Per finished job: seconds it ran in the background and seconds a stage waited for it."""
        return {name: {"ran_s": ran, "waited_s": self.waited.get(name, 0.0)} for name, ran in self._ran.items()}

    def close(self) -> None:
        """Wait for the jobs no stage asked for (their errors are dropped: nothing needed them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def warm_device(setting: str) -> None:
    """The first CUDA work of the process, while the command still imports its libraries (``loopvq-calibrate``
    submits it before the pipeline's imports): the CUDA context, cuBLAS and the attention kernels, loaded by a
    bf16 matmul and a causal attention at head width 128 with their backward on small inputs. ``setting`` is
    ``model.device``; nothing happens without CUDA, for a CPU setting, or under ``accelerate launch`` (a
    process's device is known only once its process group starts)."""
    if setting == "cpu" or int(os.environ.get("WORLD_SIZE", "1")) > 1 or not torch.cuda.is_available():
        return
    device = torch.device("cuda" if setting == "auto" else setting)
    if device.type != "cuda":
        return
    with torch.cuda.device(device):
        a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16, requires_grad=True)
        q = torch.randn(1, 4, 1024, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        ((a @ a).float().sum() + attention.float().sum()).backward()
        torch.cuda.synchronize(device)


def warm_linalg(device: torch.device) -> None:
    """The first dense linear algebra on ``device``, on tiny inputs: TaSQ's grouping takes log-determinants
    (:func:`~loopvq_calib.calibration.tasq.grouping.set_costs`: float64 LU of batches of small matrices and of
    single ones)."""
    eye = torch.eye(4, dtype=torch.float64, device=device)
    torch.linalg.slogdet(eye.expand(3, 4, 4).contiguous())
    torch.linalg.slogdet(eye)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
