"""The fused Triton k-means kernels against float64 numpy references and the torch k-means++ draws.

They run on a CUDA GPU, or on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` with triton
installed); otherwise the module is skipped. test_kmeans.py runs the Lloyd and init behaviour tests on
this backend too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loopvq_calib import kmeans_triton
from loopvq_calib.kmeans_backends import kmeans_pp_init

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not kmeans_triton.available(DEVICE), reason="needs triton with a CUDA GPU, or TRITON_INTERPRET=1"
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k, g", [(32, 16), (20, 12), (6, 4), (600, 16), (256, 32)])  # padded K, G; tiles of 16 to 128 points
def test_lloyd_step_on_a_subset_of_problems_matches_numpy(k, g):
    x = torch.randn(4, 300, g, generator=gen(0))
    w = torch.rand(4, 300, generator=gen(1))
    w[:, :20] = 0.0
    rows = torch.tensor([3, 1])
    c = torch.randn(2, k, g, generator=gen(2))
    dev = [t.to(DEVICE) for t in (x, w, c, rows)]
    err, sums, mass = (t.cpu() for t in kmeans_triton.lloyd_step(*dev, accumulate=True))
    err_only, none_sums, none_mass = kmeans_triton.lloyd_step(*dev, accumulate=False)
    assert none_sums is None and none_mass is None
    for a, p in enumerate(rows.tolist()):
        xp, wp, cp = x[p].double().numpy(), w[p].double().numpy(), c[a].double().numpy()
        d = ((xp[:, None] - cp[None]) ** 2).sum(-1)
        near = d.argmin(-1)
        np.testing.assert_allclose(err[a].item(), (wp * d.min(-1)).sum(), rtol=1e-4)
        np.testing.assert_allclose(err_only[a].item(), (wp * d.min(-1)).sum(), rtol=1e-4)
        np.testing.assert_allclose(mass[a].numpy(), np.bincount(near, weights=wp, minlength=k), rtol=1e-5, atol=1e-6)
        ref = np.stack([(wp[near == r, None] * xp[near == r]).sum(0) for r in range(k)])
        np.testing.assert_allclose(sums[a].numpy(), ref, rtol=1e-4, atol=1e-4)


def test_fused_kmeans_pp_makes_the_torch_draws():
    """Same uniforms, same rules: the fused draws pick the same points as the torch draws, including
    blocks of zero weight, a problem longer than one draw block and points past the last full block."""
    n = kmeans_triton.DRAW_BLOCK * 2 + 37
    x = torch.randn(3, n, 8, generator=gen(3))
    w = torch.rand(3, n, generator=gen(4))
    w[0, : kmeans_triton.DRAW_BLOCK] = 0.0  # the whole first block has no mass
    w[1, -50:] = 0.0
    fused = kmeans_pp_init(x.to(DEVICE), w.to(DEVICE), 24, gen(5), fused=True).cpu()
    assert torch.equal(fused, kmeans_pp_init(x, w, 24, gen(5)))
    assert not (fused[0, :, None] == x[0, None, : kmeans_triton.DRAW_BLOCK]).all(-1).any()


def test_available_needs_triton_and_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kmeans_triton.available("cuda") and not kmeans_triton.available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kmeans_triton.available("cpu")
    monkeypatch.setattr(kmeans_triton, "triton", None)
    assert not kmeans_triton.available("cuda")
