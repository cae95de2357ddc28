"""The fused nearest-codeword kernel against the torch path of ``codec.nearest``, its probe, and the codec's
dispatch around it.

The kernel runs on a CUDA GPU, or on CPU tensors in Triton's interpreter: without a GPU the comparison runs
in a child process with ``TRITON_INTERPRET=1`` (the variable has to be set before triton is imported).
Without triton the kernel tests are skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import run_kernel_script

from loopvq_calib.codes import codec
from loopvq_calib.kernels import nearest as nearest_kernel
from loopvq_calib.kernels.backends import triton

needs_triton = pytest.mark.skipif(triton is None, reason="needs triton")

COMPARE = r"""
import json, sys, torch
from loopvq_calib.kernels import nearest as nearest_kernel
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
    got = nearest_kernel.nearest(z.to(device), cb.to(device)).cpu()
    out[str(shape)] = {"equal": torch.equal(got, nearest(z, cb)), "dtype": str(got.dtype), "shape": list(got.shape)}
# ties: codewords 3 and 7 are the same vector, every token sits on it -> the lower index
cb = torch.randn(1, 1, 16, 16, generator=gen)
cb[0, 0, 7] = cb[0, 0, 3]
z = cb[0, 0, 3].expand(5, 1, 1, 16).clone()
out["ties"] = nearest_kernel.nearest(z.to(device), cb.to(device)).flatten().tolist()
no_tokens = torch.zeros(0, 2, 3, 16).to(device)
out["empty"] = list(nearest_kernel.nearest(no_tokens, torch.randn(2, 3, 16, 16).to(device)).shape)
nearest_kernel.probe(device, 64, 16)  # compiles, runs and agrees: no error
real = nearest_kernel.nearest
nearest_kernel.nearest = lambda z, cb: real(z, cb).flip(-1)  # a kernel that writes its codes in the wrong places
try:
    nearest_kernel.probe(device, 64, 16)
    out["wrong_kernel"] = "passed"
except RuntimeError as err:
    out["wrong_kernel"] = str(err)
print(json.dumps(out))
"""


@needs_triton
def test_kernel_picks_the_torch_paths_codes_lowest_index_on_ties_and_its_probe_checks_that():
    out = run_kernel_script(COMPARE)
    for shape in [
        "(70, 2, 3, 2, 3, 256, 16)",
        "(64, 2, 4, 1, 4, 32, 16)",
        "(33, 3, 2, 3, 1, 16, 32)",
        "(1, 1, 1, 1, 1, 64, 16)",
    ]:
        n, h, g = eval(shape)[:3]
        assert out[shape] == {"equal": True, "dtype": "torch.int64", "shape": [n, h, g]}, shape
    assert out["ties"] == [3] * 5
    assert out["empty"] == [0, 2, 3]
    assert (
        out["wrong_kernel"].startswith("it agrees with the torch reference on ")
        and "% of a probe's codes" in out["wrong_kernel"]
    )


def test_the_probes_reference_is_the_brute_force_nearest_codeword():
    """reference(): the lowest index of the smallest squared distance, shared codebooks broadcast (worked by hand
    on two codewords at equal distance)."""
    cb = torch.tensor([[[[0.0, 0.0], [2.0, 0.0], [0.0, 3.0]]]])  # one shared codebook, K 3, G 2
    z = torch.tensor([[[[1.0, 0.0]], [[0.1, 2.9]]]])  # [N 1, H 2, n 1, G 2]: a tie between 0 and 1, then codeword 2
    assert nearest_kernel.reference(z, cb).tolist() == [[[0], [2]]]


def test_supported_shapes():
    assert nearest_kernel.supports(256, 16) and nearest_kernel.supports(256, 32) and nearest_kernel.supports(16, 16)
    assert not nearest_kernel.supports(256, 8)  # below the dot's smallest inner size
    assert not nearest_kernel.supports(512, 32)  # codebook tile too large
    assert not nearest_kernel.supports(512, 16)  # within the tile, but above the K the kernel was timed for
    assert not nearest_kernel.supports(8, 16)  # below the dot's smallest inner size
    assert not nearest_kernel.supports(200, 16)  # not a power of two


def test_cpu_tensors_keep_the_torch_path(monkeypatch):
    """On the CPU the codec's dispatch never considers the kernel, even where Triton could run (the interpreter)."""

    def kernel(*args):
        raise AssertionError("the kernel was called for CPU tensors")

    monkeypatch.setattr(nearest_kernel, "nearest", kernel)
    z, cb = torch.randn(4, 1, 2, 16), torch.randn(1, 2, 16, 16)
    assert not nearest_kernel.candidate(z.device, 16, 16).auto
    assert torch.equal(codec.nearest(z, cb), nearest_kernel.reference(z, cb))
