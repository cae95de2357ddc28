"""The one dispatch rule (kernels/backends.py) on stand-in candidates: an explicit request honoured or refused
with its reason, ``auto`` taking the first candidate that is available, fits and passes its probe with one
warning per reason for each one skipped, probes run once per key (also from two threads), a run that fails
the way a kernel fails here handing the call to the next candidate; and Triton's availability check."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from loopvq_calib.kernels import backends
from loopvq_calib.kernels.backends import Backend, BackendUnavailable, Candidate, Dispatcher

CPU = torch.device("cpu")
CHOICES = (Backend.AUTO, Backend.CUDA, Backend.TRITON, Backend.TORCH)


@pytest.fixture
def logged(monkeypatch, caplog):
    """The package's warnings as caplog sees them (a calibration run in this process may have stopped them
    propagating)."""
    monkeypatch.setattr(logging.getLogger("loopvq_calib"), "propagate", True)
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        yield caplog


@pytest.fixture
def triton_here(monkeypatch):
    """Triton available on the CPU (the interpreter) without running anything of it."""
    monkeypatch.setattr(backends, "triton", object())
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_an_explicit_request_is_honoured_or_refused_with_its_reason(triton_here, monkeypatch):
    """Asked for by name, a backend is returned without its probe, or refused: unavailable on the device (what it
    needs and why not), or not taking the call (the candidate's reason); an unknown name lists the choices."""
    probed = []
    triton = Candidate(Backend.TRITON, "the Triton kernel", probe=lambda: probed.append(1), probe_key=("t",))
    fitting = [Candidate(Backend.CUDA, "the CUDA kernel"), triton, Candidate(Backend.TORCH, "torch")]
    dispatch = Dispatcher()
    assert dispatch.choose("triton", fitting, what="demo", choices=CHOICES, device=CPU) is triton and probed == []
    assert dispatch.choose(Backend.TORCH, fitting, what="demo", choices=CHOICES, device=CPU).label == "torch"
    with pytest.raises(
        BackendUnavailable,
        match=r"demo: 'cuda' needs a CUDA device and torch 2.9 or newer .*, not "
        r"cpu \(device cpu is not CUDA\); use 'auto' or 'triton' or 'torch'",
    ):
        dispatch.choose("cuda", fitting, what="demo", choices=CHOICES, device=CPU)
    narrow = Candidate(Backend.TRITON, "the Triton kernel", unfit=lambda: "K 512 is above 256")
    with pytest.raises(BackendUnavailable, match="demo: 'triton' does not take this call: K 512 is above 256; use"):
        dispatch.choose("triton", [narrow], what="demo", choices=CHOICES, device=CPU)
    with pytest.raises(ValueError, match="demo: 'fast' is not one of auto, cuda, triton, torch"):
        dispatch.choose("fast", fitting, what="demo", choices=CHOICES, device=CPU)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(
        BackendUnavailable,
        match=r"'triton' needs the triton package and a CUDA device of compute "
        r"capability 8.0 or newer, not cpu \(device cpu is not CUDA and "
        "TRITON_INTERPRET is not 1\\)",
    ):
        dispatch.choose("triton", fitting, what="demo", choices=CHOICES, device=CPU)


def test_auto_takes_the_first_that_runs_and_warns_once_per_reason(triton_here, logged):
    """Candidates ``auto`` does not consider are passed over silently; unavailable, unfitting and failing ones
    each give one warning per reason, naming what serves instead; nothing that runs is an error naming every
    reason."""

    def failing():
        raise RuntimeError("ptxas missing")

    candidates = [
        Candidate(Backend.CUDA, "the CUDA kernel"),  # unavailable on the CPU
        Candidate(Backend.TRITON, "the narrow kernel", unfit=lambda: "K 512 is above 256"),
        Candidate(Backend.TRITON, "the failing kernel", probe=failing, probe_key=("failing",)),
        Candidate(Backend.TRITON, "the GPU-only kernel", auto=False),
        Candidate(Backend.TORCH, "torch"),
    ]
    dispatch = Dispatcher()
    for _ in range(3):
        assert dispatch.choose("auto", candidates, what="demo", choices=CHOICES, device=CPU).label == "torch"
    lines = logged.text.splitlines()
    assert len(lines) == 3
    assert "demo auto: using torch on cpu, not the CUDA kernel: device cpu is not CUDA" in lines[0]
    assert "demo auto: using torch on cpu, not the narrow kernel: K 512 is above 256" in lines[1]
    assert (
        "demo auto: using torch on cpu, not the failing kernel: its probe failed (RuntimeError: ptxas missing)"
        in lines[2]
    )
    assert "GPU-only" not in logged.text
    with pytest.raises(
        BackendUnavailable,
        match=r"demo: no backend runs this call on cpu \(the CUDA kernel: device "
        r"cpu is not CUDA; the narrow kernel: K 512 is above 256; ",
    ):
        dispatch.choose("auto", candidates[:4], what="demo", choices=CHOICES, device=CPU)


def test_probes_run_once_per_key_even_from_two_threads(triton_here):
    """A probe's outcome is kept per key: later choices, and a second thread asking while the first probes, find
    it; another key probes again."""
    started, release, calls = threading.Event(), threading.Event(), []

    def slow_probe():
        calls.append(threading.current_thread().name)
        started.set()
        release.wait(10)

    def candidate(key):
        return Candidate(Backend.TRITON, "the Triton kernel", probe=slow_probe, probe_key=key)

    dispatch = Dispatcher()
    results = []
    threads = [threading.Thread(target=lambda: results.append(dispatch.probe(candidate(("k", 1))))) for _ in range(2)]
    threads[0].start()
    started.wait(10)
    threads[1].start()
    release.set()
    for t in threads:
        t.join(10)
    assert results == ["", ""] and len(calls) == 1
    chosen = dispatch.choose("auto", [candidate(("k", 1))], what="demo", choices=CHOICES, device=CPU)
    assert chosen.probe_key == ("k", 1)
    assert len(calls) == 1 and dispatch.probed() == {("k", 1): ""}
    dispatch.probe(candidate(("k", 2)))
    assert len(calls) == 2


def test_a_run_that_fails_like_a_kernel_hands_the_call_on_under_auto(monkeypatch, logged):
    """Under ``auto`` a ``fails_with`` error warns (once per reason) and the next candidate that runs serves; an
    explicit request raises it; other errors always propagate. (Every backend available: a stand-in device.)"""

    class BuildFailed(RuntimeError):
        pass

    def broken():
        raise BuildFailed("nvrtc: error on purpose")

    monkeypatch.setattr(backends, "unavailable", lambda backend, device: "")
    candidates = [
        Candidate(Backend.CUDA, "the CUDA kernel", run=broken, fails_with=(BuildFailed,)),
        Candidate(Backend.TRITON, "the Triton kernel", run=lambda: "triton served"),
    ]
    dispatch = Dispatcher()
    for _ in range(2):
        assert dispatch.run("auto", candidates, what="demo", choices=CHOICES, device=CPU) == "triton served"
    assert (
        logged.text.count("demo auto: using the Triton kernel on cpu, not the CUDA kernel: nvrtc: error on purpose")
        == 1
    )
    with pytest.raises(BuildFailed, match="on purpose"):
        dispatch.run("cuda", candidates, what="demo", choices=CHOICES, device=CPU)
    other = Candidate(Backend.CUDA, "the CUDA kernel", run=lambda: 1 / 0, fails_with=(BuildFailed,))
    with pytest.raises(ZeroDivisionError):
        dispatch.run("auto", [other, candidates[1]], what="demo", choices=CHOICES, device=CPU)


def test_triton_needs_the_package_and_cuda_8_0_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(backends, "triton", object())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert backends.available(Backend.TRITON, "cuda") and not backends.available(Backend.TRITON, "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    assert backends.unavailable(Backend.TRITON, "cuda") == "compute capability 7.0 is below 8.0"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.available(Backend.TRITON, "cpu")
    monkeypatch.setattr(backends, "triton", None)
    assert backends.unavailable(Backend.TRITON, "cuda") == "the triton package is not installed"
    assert backends.available(Backend.TORCH, "cpu") and backends.available(Backend.FAISS, "cuda")
