"""CUDA kernels compiled from source at run time (NVRTC): the one place that builds them.

torch has no public run-time compile API. :func:`build_kernel` uses ``torch.cuda._compile_kernel`` (private:
NVRTC through the CUDA runtime torch ships, about a second per build, nothing else installed) and the
``set_shared_memory_config`` of the kernel object it returns (torch 2.9 and newer) to allow more than 48 KiB of
dynamic shared memory. The public route, ``torch.utils.cpp_extension.load_inline``, needs nvcc and ninja on
the machine and tens of seconds per build, and the decode kernel is built once per set of constants (shape);
so it was not taken. A torch without these is refused (:meth:`CudaBuilds.unavailable`) and the caller's
dispatch (:mod:`~loopvq_calib.kernels.backends`) takes the Triton kernel.

:data:`BUILDS` is the process's record of NVRTC kernels: those built (per constants, shared memory and
device), the first failed build (later calls are refused without building again), and each device's
arrival counters, which every launch of a split kernel on that device shares (they outlive any one cache:
a captured CUDA graph holds them).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

REQUIREMENT = "a CUDA device and torch 2.9 or newer (kernels compiled at run time)"


class BuildError(RuntimeError):
    """A kernel could not be built, configured or launched here (no NVRTC, a compile error, a shared-memory
    limit, a failed launch)."""


class LaunchError(BuildError):
    """A built kernel failed to launch (the call goes to Triton like a failed build; later builds still try)."""


def build_kernel(source: str, name: str, *, shared: int, device: int) -> Any:
    """The ``extern "C"`` kernel ``name`` of ``source`` compiled with NVRTC for CUDA device ``device``, allowed
    ``shared`` bytes of dynamic shared memory; call it as ``kernel(grid=, block=, shared_mem=, args=, stream=)``.
    Raises BuildError."""
    compile_kernel = getattr(torch.cuda, "_compile_kernel", None)
    if compile_kernel is None:
        raise BuildError("this torch has no torch.cuda._compile_kernel (NVRTC)")
    try:
        with torch.cuda.device(device):
            kernel = compile_kernel(source, name)
            configure = getattr(kernel, "set_shared_memory_config", None)
            if configure is None:
                raise BuildError("this torch's compiled kernels cannot raise their shared-memory limit")
            configure(shared)
    except BuildError:
        raise
    except (RuntimeError, OSError, AttributeError) as err:
        raise BuildError(str(err)) from err
    return kernel


class CudaBuilds:
    """NVRTC kernels of this process (module docstring): builds, the first failure, arrival counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[tuple, Any] = {}
        self._counters: dict[str, list[torch.Tensor]] = {}
        self.failure: BuildError | None = None

    def unavailable(self, device: torch.device) -> str:
        """Why no NVRTC kernel runs on ``device`` ('' when one may)."""
        if self.failure is not None:
            return f"an earlier build failed: {self.failure}"
        if device.type != "cuda":
            return f"device {device} is not CUDA"
        if not hasattr(torch.cuda, "_compile_kernel"):
            return "this torch has no torch.cuda._compile_kernel (NVRTC)"
        return ""

    def kernel(self, source: str, name: str, *, defines: tuple[tuple[str, int], ...], shared: int, device: int) -> Any:
        """``name`` built from ``source`` with ``defines`` prepended as ``#define``s (:func:`build_kernel`),
        once per (defines, shared, device); the first failure is kept (:meth:`unavailable`) and raised."""
        key = (name, defines, shared, device)
        with self._lock:
            kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel
        text = "".join(f"#define {k} {v}\n" for k, v in defines) + source
        try:
            kernel = build_kernel(text, name, shared=shared, device=device)
        except BuildError as err:
            failure = BuildError(f"{name} with {dict(defines)}: {err}")
            with self._lock:
                self.failure = self.failure or failure
            raise failure from err
        with self._lock:
            self._kernels[key] = kernel
        return kernel

    def counters(self, device: torch.device, count: int) -> torch.Tensor:
        """The int32 arrival counters of ``device`` (with its index), at least ``count``: a split kernel's last
        split to arrive resets its counter, so one zeroed buffer serves every launch and CUDA-graph replay on
        the device, provided launches do not run concurrently on two streams. A buffer that grows is replaced
        and the old one kept (a captured graph may hold it); none can be made during a capture (LaunchError:
        call once before capturing)."""
        with self._lock:
            kept = self._counters.setdefault(str(device), [])
            if not kept or kept[-1].numel() < count:
                if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise LaunchError(
                        f"no arrival counters for {count} launches yet during CUDA-graph capture; "
                        "run the call once before capturing"
                    )
                kept.append(torch.zeros(max(4096, 1 << (count - 1).bit_length()), dtype=torch.int32, device=device))
            return kept[-1]


BUILDS = CudaBuilds()
