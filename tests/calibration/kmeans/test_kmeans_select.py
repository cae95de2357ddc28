"""Which k-means backend runs (kmeans_select.py): ``auto`` and the explicit choices on faked devices, what is
refused and what is logged."""

from __future__ import annotations

import sys

import pytest
import torch
from support.builders import CPU, blobs

K = 16

from loopvq_calib.calibration.kmeans import select as kmeans_select
from loopvq_calib.calibration.kmeans.select import resolve_backend
from loopvq_calib.calibration.kmeans.solvers import weighted_kmeans
from loopvq_calib.config.schema import KMeansConfig
from loopvq_calib.kernels import kmeans as kmeans_triton


def test_backend_resolution_and_missing_faiss(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kmeans_triton, "triton", object())  # installed
    monkeypatch.setattr(kmeans_triton, "works", lambda device, k=16, g=16, n=0: True)  # compiles and runs there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
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
    with pytest.raises(ValueError, match="quant.codebook_size 4096 x group size 12 is larger"):
        resolve_backend("triton", "cuda", (4096, 12))
    with pytest.raises(ValueError, match=r"kmeans.backend: 'triton' needs .* a CUDA device .*, not cpu"):
        resolve_backend("triton", CPU)
    monkeypatch.setattr(kmeans_triton, "works", lambda device, k=16, g=16, n=0: False)  # e.g. no C compiler: auto falls back
    assert resolve_backend("auto", torch.device("cuda")) == "torch" and resolve_backend("triton", "cuda") == "triton"
    monkeypatch.setattr(kmeans_triton, "triton", None)  # not installed: auto falls back to torch
    assert resolve_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ValueError, match="kmeans.backend: 'triton' needs the triton package"):
        resolve_backend("triton", "cuda")
    assert resolve_backend("faiss", CPU) == "faiss"
    with pytest.raises(ValueError, match="kmeans.backend"):
        resolve_backend("sklearn", CPU)
    monkeypatch.setitem(sys.modules, "faiss", None)
    x, w = blobs(1, 100, 4, 2, seed=10)
    with pytest.raises(ImportError, match="kmeans.backend"):
        weighted_kmeans(x, w, x[:, :K], cfg=KMeansConfig(), backend="faiss", device=CPU)


def test_auto_logs_why_it_does_not_use_triton(monkeypatch, caplog):
    """On a CUDA device ``auto`` says why it falls back to torch: codebook too large for the kernels' tile,
    an old GPU, no triton; on the CPU torch is the plain choice and nothing is logged."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kmeans_triton, "triton", object())
    monkeypatch.setattr(kmeans_triton, "works", lambda device, k=16, g=16, n=0: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    kmeans_select.warn_once.cache_clear()
    with caplog.at_level("WARNING", logger="loopvq_calib"):
        assert resolve_backend("auto", "cuda", (256, 16)) == "triton" and caplog.text == ""
        assert resolve_backend("auto", "cuda", (4096, 12)) == resolve_backend("auto", "cuda", (4096, 12)) == "torch"
        assert caplog.text.count("quant.codebook_size 4096 x group size 12 exceeds the kernels' codebook tile") == 1
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
        assert resolve_backend("auto", "cuda:0", (256, 16)) == "torch"
        assert "using the torch backend on cuda:0, not the fused Triton kernels: compute capability 7.5 is below 8.0" in caplog.text
        monkeypatch.setattr(kmeans_triton, "triton", None)
        assert resolve_backend("auto", "cuda", (256, 16)) == "torch"
        assert "the triton package is not installed" in caplog.text
        caplog.clear()
        assert resolve_backend("auto", CPU, (4096, 12)) == "torch" and caplog.text == ""
