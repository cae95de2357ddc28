"""Which k-means backend runs (calibration/kmeans/select.py): ``auto`` and the explicit choices on faked devices,
what is refused and what is logged."""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from support.builders import CPU, blobs

from loopvq_calib.calibration.kmeans.select import resolve_backend
from loopvq_calib.calibration.kmeans.solvers import weighted_kmeans
from loopvq_calib.config.schema import KMEANS_BACKENDS, KMeansConfig
from loopvq_calib.kernels import backends, kmeans as kmeans_kernels

K = 16


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of compute capability 9.0 with triton installed and the kernels' probe passing, on the CPU;
    the dispatcher starts afresh and logs where caplog sees it. Returns the probe's calls."""
    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(backends, "triton", object())  # installed
    monkeypatch.setattr(kmeans_kernels, "probe", lambda device, k, g, n=0: calls.append((str(device), k, g, n)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # H100 / H200
    monkeypatch.setattr(logging.getLogger("loopvq_calib"), "propagate", True)
    backends.DISPATCH.clear()
    yield calls
    backends.DISPATCH.clear()  # the faked probes' outcomes stay with this test


def test_backend_resolution_and_missing_faiss(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))  # T4: no TF32 dot
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match=r"'triton' needs .* compute capability 8.0 or newer, not cuda"):
        resolve_backend("triton", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # H100 / H200
    assert resolve_backend("auto", CPU) == "torch" and resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("triton", "cuda:1") == "triton" and resolve_backend("torch", "cuda") == "torch"
    # codebook tiles up to 8,192 entries x dimensions (powers of two >= 16): K 256 x G 32, K 512 x G 16
    assert resolve_backend("auto", "cuda", (512, 16)) == resolve_backend("auto", "cuda", (200, 30)) == "triton"
    assert resolve_backend("auto", "cuda", (4096, 12)) == resolve_backend("auto", "cuda", (256, 33)) == "torch"
    with pytest.raises(
        ValueError, match="'triton' does not take this call: quant.codebook_size 4096 x group size 12 exceeds"
    ):
        resolve_backend("triton", "cuda", (4096, 12))
    with pytest.raises(ValueError, match=r"kmeans.backend: 'triton' needs .* a CUDA device .*, not cpu"):
        resolve_backend("triton", CPU)

    def broken(device, k, g, n=0):  # e.g. no C compiler: auto falls back, an explicit request is taken as asked
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kmeans_kernels, "probe", broken)
    assert resolve_backend("auto", torch.device("cuda"), (64, 16)) == "torch"
    assert resolve_backend("triton", "cuda", (64, 16)) == "triton"
    monkeypatch.setattr(backends, "triton", None)  # not installed: auto falls back to torch
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="kmeans.backend: 'triton' needs the triton package"):
        resolve_backend("triton", "cuda")
    assert resolve_backend("faiss", CPU) == "faiss"
    with pytest.raises(ValueError, match="kmeans.backend: 'sklearn' is not one of auto, faiss, torch, triton"):
        resolve_backend("sklearn", CPU)
    monkeypatch.setitem(sys.modules, "faiss", None)
    x, w = blobs(1, 100, 4, 2, seed=10)
    with pytest.raises(ImportError, match="kmeans.backend"):
        weighted_kmeans(x, w, x[:, :K], cfg=KMeansConfig(), backend="faiss", device=CPU)


def test_auto_logs_why_it_does_not_use_triton(fake_cuda, monkeypatch, caplog):
    """On a CUDA device ``auto`` says why it falls back to torch, once per reason: codebook too large for the
    kernels' tile, an old GPU, no triton, a failed probe; on the CPU torch is the plain choice and nothing is
    logged."""
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        assert resolve_backend("auto", "cuda", (256, 16)) == "triton" and caplog.text == ""
        assert resolve_backend("auto", "cuda", (4096, 12)) == resolve_backend("auto", "cuda", (4096, 12)) == "torch"
        assert caplog.text.count("quant.codebook_size 4096 x group size 12 exceeds the kernels' codebook tile") == 1
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
        assert resolve_backend("auto", "cuda:0", (256, 16)) == "torch"
        assert (
            "using the torch backend on cuda:0, not the fused Triton kernels: compute capability 7.5 is below 8.0"
            in caplog.text
        )
        monkeypatch.setattr(backends, "triton", None)
        assert resolve_backend("auto", "cuda", (256, 16)) == "torch"
        assert "the triton package is not installed" in caplog.text
        caplog.clear()
        assert resolve_backend("auto", CPU, (4096, 12)) == "torch" and caplog.text == ""


def test_the_probe_runs_once_per_device_and_shape(fake_cuda, monkeypatch, caplog):
    """``auto`` probes the kernels once per (device, K, G, points): ``cuda`` and ``cuda:0`` are one device (the
    current one), another shape or device is probed again; a failed probe is remembered and warned about once."""
    for device in ("cuda", "cuda:0", torch.device("cuda", 0)):
        assert resolve_backend("auto", device, (256, 16), points=1000) == "triton"
    assert fake_cuda == [("cuda:0", 256, 16, 1000)]
    resolve_backend("auto", "cuda:1", (256, 16), points=1000)
    resolve_backend("auto", "cuda:0", (256, 32), points=1000)
    assert fake_cuda[1:] == [("cuda:1", 256, 16, 1000), ("cuda:0", 256, 32, 1000)]

    def broken(device, k, g, n=0):
        fake_cuda.append("broken")
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kmeans_kernels, "probe", broken)
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        assert resolve_backend("auto", "cuda", (64, 16)) == resolve_backend("auto", "cuda:0", (64, 16)) == "torch"
    assert fake_cuda.count("broken") == 1
    assert (
        caplog.text.count(
            "kmeans.backend auto: using the torch backend on cuda, not the fused Triton kernels: "
            "its probe failed (RuntimeError: Failed to find C compiler)"
        )
        == 1
    )


def test_the_configs_backend_names_are_the_kernels_kmeans_choices():
    """config/schema.py keeps its own names (the config imports no kernels); they are the dispatch's k-means choices."""
    assert KMEANS_BACKENDS == tuple(b.value for b in backends.KMEANS_CHOICES)
