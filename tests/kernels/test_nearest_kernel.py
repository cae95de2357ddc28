"""The fused nearest-codeword kernel against the torch path of ``codec.nearest``.

The kernel runs on a CUDA GPU, or on CPU tensors in Triton's interpreter: without a GPU the comparison runs
in a child process with ``TRITON_INTERPRET=1`` (the variable has to be set before triton is imported).
Without triton everything here is skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import run_kernel_script

from loopvq_calib.kernels import nearest as nearest_triton

pytestmark = pytest.mark.skipif(nearest_triton.triton is None, reason="needs triton")

COMPARE = r"""
import json, sys, torch
from loopvq_calib.kernels import nearest as nearest_triton
from loopvq_calib.codes.codec import nearest
device = torch.device(sys.argv[1])
gen = torch.Generator().manual_seed(0)
out = {}
# (tokens, heads, groups, codebook heads, codebook groups, K, G): a partial last block, shared heads,
# shared groups, both shared, G = 32, a single token
for shape in [(70, 2, 3, 2, 3, 256, 16), (64, 2, 4, 1, 4, 32, 16), (33, 3, 2, 3, 1, 16, 32), (1, 1, 1, 1, 1, 64, 16)]:
    n, h, g_, hc, nc, k, g = shape
    z = torch.randn(n, h, g_, g, generator=gen)
    cb = torch.randn(hc, nc, k, g, generator=gen)
    got = nearest_triton.nearest(z.to(device), cb.to(device)).cpu()
    out[str(shape)] = {"equal": torch.equal(got, nearest(z, cb)), "dtype": str(got.dtype), "shape": list(got.shape)}
# ties: codewords 3 and 7 are the same vector, every token sits on it -> the lower index
cb = torch.randn(1, 1, 16, 16, generator=gen)
cb[0, 0, 7] = cb[0, 0, 3]
z = cb[0, 0, 3].expand(5, 1, 1, 16).clone()
out["ties"] = nearest_triton.nearest(z.to(device), cb.to(device)).flatten().tolist()
out["empty"] = list(nearest_triton.nearest(torch.zeros(0, 2, 3, 16).to(device), torch.randn(2, 3, 16, 16).to(device)).shape)
print(json.dumps(out))
"""


def test_kernel_picks_the_torch_paths_codes_lowest_index_on_ties():
    out = run_kernel_script(COMPARE)
    for shape in ["(70, 2, 3, 2, 3, 256, 16)", "(64, 2, 4, 1, 4, 32, 16)", "(33, 3, 2, 3, 1, 16, 32)", "(1, 1, 1, 1, 1, 64, 16)"]:
        n, h, g = eval(shape)[:3]
        assert out[shape] == {"equal": True, "dtype": "torch.int64", "shape": [n, h, g]}, shape
    assert out["ties"] == [3] * 5
    assert out["empty"] == [0, 2, 3]


def test_supported_shapes():
    assert nearest_triton.supports(256, 16) and nearest_triton.supports(256, 32) and nearest_triton.supports(16, 16)
    assert not nearest_triton.supports(256, 8)  # below the dot's smallest inner size
    assert not nearest_triton.supports(512, 32)  # codebook tile too large
    assert not nearest_triton.supports(512, 16)  # within the tile, but above the K the kernel was timed for
    assert not nearest_triton.supports(8, 16)  # below the dot's smallest inner size
    assert not nearest_triton.supports(200, 16)  # not a power of two


def test_cpu_tensors_keep_the_torch_path():
    z, cb = torch.randn(4, 1, 2, 16), torch.randn(1, 2, 16, 16)
    assert not nearest_triton.usable(z, cb)
