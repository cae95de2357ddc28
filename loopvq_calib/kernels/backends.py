"""The kernel backends and the one rule that picks one, for every user: k-means, the codec's nearest-codeword
search and codeword lookup, decode attention and the quantized cache.

:class:`Backend` names every backend; each user accepts its own choices (:data:`KMEANS_CHOICES`,
:data:`CODEC_CHOICES`, :data:`DECODE_CHOICES`, :data:`CACHE_CHOICES`). Decode attention's kernels are listed
once, in :data:`DECODE_CANDIDATES`, in the order ``auto`` tries them at both serving call sites. The optional
triton package is imported here and nowhere else (``triton`` and ``tl`` are None without it). :func:`unavailable`
is the one availability check per backend: Triton needs triton and a CUDA device of compute capability 8.0 or
newer (the kernels' TF32 dots), or any device under ``TRITON_INTERPRET=1``; the CUDA kernels what
:mod:`~loopvq_calib.kernels.cuda_build` needs; torch and faiss run anywhere.

:meth:`Dispatcher.choose` is the dispatch rule. An explicit request is honoured or refused with its reason
(:class:`BackendUnavailable`). ``auto`` takes the first candidate it considers for the call that is available,
takes the call and passes its probe (a kernel family's "compiles and agrees with a reference on a probe", run
once per process, device and shape), and logs one warning per reason for each preferred candidate it skipped.
:meth:`Dispatcher.run` runs the choice too: under ``auto`` a run that fails the way a kernel can fail here
(``Candidate.fails_with``: a build or a launch) warns once and the next candidate serves the call.
:data:`DISPATCH` is the process's dispatcher: the probes' outcomes and the warnings given.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

import torch

from . import cuda_build

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch paths serve
    triton = tl = None

log = logging.getLogger("loopvq_calib")
T = TypeVar("T")


class Backend(str, Enum):
    """A kernel backend; ``auto`` lets :meth:`Dispatcher.choose` pick one."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CUDA = "cuda"
    FAISS = "faiss"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Backend | str, choices: tuple[Backend, ...], *, what: str) -> Backend:
        """``value`` as one of ``choices``; ValueError naming ``what`` and the choices otherwise."""
        backend = next((c for c in choices if c.value == value), None)
        if backend is None:
            raise ValueError(f"{what}: {value!r} is not one of {', '.join(c.value for c in choices)}")
        return backend


KMEANS_CHOICES = (Backend.AUTO, Backend.FAISS, Backend.TORCH, Backend.TRITON)  # kmeans.backend
CODEC_CHOICES = (Backend.AUTO, Backend.TRITON, Backend.TORCH)  # nearest codeword, codeword lookup
REQUIREMENTS = {
    Backend.TRITON: "the triton package and a CUDA device of compute capability 8.0 or newer",
    Backend.CUDA: cuda_build.REQUIREMENT,
}


class BackendUnavailable(ValueError):
    """An explicit backend request that cannot be honoured here, or no backend that runs a call."""


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``n`` and >= ``floor``."""
    return max(floor, 1 << (int(n) - 1).bit_length())


def unavailable(backend: Backend, device: torch.device | str) -> str:
    """Why ``backend`` cannot run on ``device`` ('' when it can)."""
    device = torch.device(device)
    if backend is Backend.TRITON:
        return _triton_unavailable(device)
    if backend is Backend.CUDA:
        return cuda_build.BUILDS.unavailable(device)
    return ""


def available(backend: Backend, device: torch.device | str) -> bool:
    """Whether ``backend`` can run on ``device`` (:func:`unavailable` has no reason)."""
    return not unavailable(backend, device)


def _triton_unavailable(device: torch.device) -> str:
    if triton is None:
        return "the triton package is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ""
    if device.type != "cuda":
        return f"device {device} is not CUDA and TRITON_INTERPRET is not 1"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return f"compute capability {major}.{minor} is below 8.0"
    return ""


@dataclass(frozen=True)
class Candidate(Generic[T]):
    """One backend a call may take. ``label`` names it in messages; ``auto``: whether ``auto`` considers it for
    this call (e.g. Triton k-means only on CUDA); ``unfit``: why this call does not fit it ('' or None when it
    does); ``probe``: raises where its kernels do not compile, run or agree with a reference, run once per
    ``probe_key`` (family, device, shape); ``run``: the call itself, whose ``fails_with`` errors mean "does not
    work here" under ``auto``."""

    backend: Backend
    label: str
    auto: bool = True
    unfit: Callable[[], str] | None = None
    probe: Callable[[], Any] | None = None
    probe_key: tuple = ()
    run: Callable[[], T] | None = None
    fails_with: tuple[type[BaseException], ...] = ()


# decode attention's kernels, in the order ``auto`` tries them; the last takes every call (the fallback). Both
# serving call sites read this list: decode attention fills in each one's call, the cache checks a backend with it.
DECODE_CANDIDATES: tuple[Candidate, ...] = (
    Candidate(Backend.CUDA, "the CUDA decode kernel"),
    Candidate(Backend.TRITON, "the Triton decode kernel"),
)
DECODE_CHOICES = (Backend.AUTO, *(c.backend for c in DECODE_CANDIDATES))  # decode attention from coded pages
CACHE_CHOICES = (*DECODE_CHOICES, Backend.TORCH)  # the quantized cache's decode steps (torch: no kernel)


class Dispatcher:
    """The dispatch rule and what it learns in this process: each probe's outcome, the warnings given."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probed: dict[tuple, str] = {}
        self._probing: dict[tuple, threading.Lock] = {}
        self._warned: set[str] = set()

    def choose(
        self,
        requested: Backend | str,
        candidates: list[Candidate[T]],
        *,
        what: str,
        choices: tuple[Backend, ...],
        device: torch.device | str,
    ) -> Candidate[T]:
        """The candidate that serves: the one ``requested`` (refused with its reason when it is unavailable or
        does not take the call; it is not probed), or under ``auto`` the first that runs (module docstring).
        ``what`` names the choice in messages; every choice but ``auto`` has a candidate."""
        wanted = Backend.parse(requested, choices, what=what)
        if wanted is Backend.AUTO:
            return self._first(candidates, what=what, device=device, skipped=[])
        candidate = next(c for c in candidates if c.backend is wanted)
        others = " or ".join(repr(c.value) for c in choices if c is not wanted)
        reason = unavailable(wanted, device)
        if reason:
            raise BackendUnavailable(
                f"{what}: {wanted.value!r} needs {REQUIREMENTS[wanted]}, not {device} ({reason}); use {others}"
            )
        reason = candidate.unfit() if candidate.unfit else ""
        if reason:
            raise BackendUnavailable(f"{what}: {wanted.value!r} does not take this call: {reason}; use {others}")
        return candidate

    def run(
        self,
        requested: Backend | str,
        candidates: list[Candidate[T]],
        *,
        what: str,
        choices: tuple[Backend, ...],
        device: torch.device | str,
    ) -> T:
        """:meth:`choose`, then the candidate's ``run``; under ``auto`` a ``fails_with`` error warns once and the
        next candidate that runs serves (an explicit request's errors propagate)."""
        explicit = Backend.parse(requested, choices, what=what) is not Backend.AUTO
        candidate = self.choose(requested, candidates, what=what, choices=choices, device=device)
        while True:
            try:
                return candidate.run()
            except candidate.fails_with as err:
                if explicit:
                    raise
                later = candidates[candidates.index(candidate) + 1 :]
                candidate = self._first(later, what=what, device=device, skipped=[(candidate, str(err))])

    def why_not(self, candidate: Candidate, device: torch.device | str) -> str:
        """Why ``auto`` would skip ``candidate`` on ``device`` ('' when it would take it): unavailable there,
        not fitting the call, or failing its probe (probed here once per key)."""
        return (
            unavailable(candidate.backend, device)
            or (candidate.unfit() if candidate.unfit else "")
            or self.probe(candidate)
        )

    def probe(self, candidate: Candidate) -> str:
        """Why ``candidate``'s probe fails ('' when it passes or it has none), probing once per ``probe_key``."""
        if candidate.probe is None:
            return ""
        key = candidate.probe_key
        with self._lock:
            if key in self._probed:
                return self._probed[key]
            probing = self._probing.setdefault(key, threading.Lock())
        with probing:  # a second thread asking for the same key waits for the first one's outcome
            if key not in self._probed:
                try:
                    candidate.probe()
                    outcome = ""
                except Exception as err:  # compiler, driver, launch or a wrong result: any of them means "skip it"
                    outcome = f"its probe failed ({type(err).__name__}: {err})"
                with self._lock:
                    self._probed[key] = outcome
        return self._probed[key]

    def probed(self) -> dict[tuple, str]:
        """The probes run so far: key -> why it failed ('' for a pass)."""
        with self._lock:
            return dict(self._probed)

    def warn_once(self, message: str) -> None:
        """Log ``message`` as a warning the first time only."""
        with self._lock:
            if message in self._warned:
                return
            self._warned.add(message)
        log.warning(message)

    def clear(self) -> None:
        """Forget every probe outcome and warning (a test starting afresh)."""
        with self._lock:
            self._probed.clear()
            self._probing.clear()
            self._warned.clear()

    def _first(
        self,
        candidates: list[Candidate[T]],
        *,
        what: str,
        device: torch.device | str,
        skipped: list[tuple[Candidate, str]],
    ) -> Candidate[T]:
        """The first candidate ``auto`` considers that is available, fits and passes its probe; a warning (once
        per reason) for each one skipped before it."""
        for candidate in candidates:
            if not candidate.auto:
                continue
            reason = self.why_not(candidate, device)
            if not reason:
                for passed, why in skipped:
                    self.warn_once(f"{what} auto: using {candidate.label} on {device}, not {passed.label}: {why}")
                return candidate
            skipped.append((candidate, reason))
        why = "; ".join(f"{c.label}: {reason}" for c, reason in skipped) or "no candidate"
        raise BackendUnavailable(f"{what}: no backend runs this call on {device} ({why})")


DISPATCH = Dispatcher()
