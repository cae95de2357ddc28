"""The fused Triton Lloyd step (CUDA only) against the torch step it replaces."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib import kmeans_triton
from loopvq_calib.kmeans_backends import _assign

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("g,k", [(16, 256), (32, 256), (16, 64)])
def test_fused_step_equals_torch_step(g, k):
    if kmeans_triton.triton is None:
        pytest.skip("triton is not installed")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3000, g, generator=gen).cuda()
    w = torch.rand(6, 3000, generator=gen).cuda()
    c = torch.randn(6, k, g, generator=gen).cuda()
    assert kmeans_triton.available(x, k)
    err, sums, mass = kmeans_triton.lloyd_step(x, w, c)
    # reference: the chunked torch step in full fp32 (TF32 off)
    torch.backends.cuda.matmul.allow_tf32 = False
    x_sq = x.pow(2).sum(-1)
    c_sq = c.pow(2).sum(-1)[:, None, :]
    nearest = torch.baddbmm(c_sq, x, c.transpose(1, 2), alpha=-2).min(-1).indices
    ref_mass = torch.zeros(6, k, device="cuda").scatter_add_(1, nearest, w)
    ref_sums = torch.zeros(6, k, g, device="cuda").scatter_add_(1, nearest[..., None].expand(-1, -1, g), x * w[..., None])
    ref_err = (((x - c.gather(1, nearest[..., None].expand(-1, -1, g))) ** 2).sum(-1) * w).sum(-1)
    torch.testing.assert_close(err, ref_err, rtol=1e-4, atol=1e-3)
    assert (mass - ref_mass).abs().sum() / ref_mass.sum() < 1e-3  # at most a near-tie point or two moves
    assert (sums - ref_sums).abs().sum() / ref_sums.abs().sum() < 1e-3
    e2, s2, m2 = _assign(x, x_sq, w, c, 1024, accumulate=True)  # dispatches to the fused step on CUDA
    torch.testing.assert_close(m2, mass)
