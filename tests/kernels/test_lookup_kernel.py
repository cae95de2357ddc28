"""The fused codeword-lookup kernel against the torch path of ``BlockCodec.decode``: the same values (exact
copies) and the same codebook gradient.

The kernel runs on a CUDA GPU, or on CPU tensors in Triton's interpreter: without a GPU the comparison runs
in a child process with ``TRITON_INTERPRET=1`` (the variable has to be set before triton is imported).
Without triton everything here is skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import run_kernel_script

from loopvq_calib.kernels import lookup as lookup_triton

pytestmark = pytest.mark.skipif(lookup_triton.triton is None, reason="needs triton")

COMPARE = r"""
import json, sys, torch
from loopvq_calib.kernels import lookup as lookup_triton
from loopvq_calib.codes.codec import BlockCodec
from loopvq_calib.codes.layouts import BlockLayout
device = torch.device(sys.argv[1])
gen = torch.Generator().manual_seed(0)
out = {}
# (tokens, steps, heads, head_dim, G, K, codebook heads, codebook groups, per-head groups): a partial tile,
# shared heads, shared groups, one step, one token
cases = [(70, 4, 2, 16, 16, 32, 2, 4, True), (33, 2, 3, 8, 4, 16, 1, 4, False), (40, 1, 2, 32, 16, 16, 2, 1, False),
         (1, 4, 1, 16, 8, 8, 1, 1, True)]
for case in cases:
    n, steps, h, d, g, k, hc, nc, per_head = case
    perms = [torch.randperm(steps * d, generator=gen) for _ in range(h if per_head else 1)]
    groups = torch.stack(perms).view(len(perms), -1, g)
    codec = BlockCodec(BlockLayout("b", "key", tuple(range(steps)), d, h, groups), torch.randn(hc, nc, k, g, generator=gen))
    codes = codec.encode(torch.randn(n, steps, h, d, generator=gen))
    weight = torch.randn(n, steps, h, d, generator=gen)
    codec.codebook.requires_grad_(True)
    want = codec.decode(codes)  # CPU tensors: the torch path
    (want * weight).sum().backward()
    to_groups, to_block = (t.to(device) for t in codec.permutation(h, d, torch.device("cpu")))
    book = codec.codebook.detach().to(device).requires_grad_(True)
    got = lookup_triton.decode_block(codes.indices.to(device), book, to_block, to_groups=to_groups, steps=steps, head_dim=d)
    (got * weight.to(device)).sum().backward()
    grad = book.grad.cpu()
    out[str(case)] = {"values": torch.equal(got.detach().cpu(), want.detach()), "shape": list(got.shape),
                      "grad_equal": torch.equal(grad, codec.codebook.grad),
                      "grad_close": torch.allclose(grad, codec.codebook.grad, rtol=1e-5, atol=1e-5)}
print(json.dumps(out))
"""


def test_kernel_copies_the_torch_paths_codewords_and_gradient():
    out = run_kernel_script(COMPARE)
    assert len(out) == 4
    for case, got in out.items():
        n, steps, h, d = eval(case)[:4]
        assert got["values"] and got["shape"] == [n, steps, h, d], case
        assert got["grad_close"], case
        if not torch.cuda.is_available():  # CPU: the same index_add_ as the torch path's backward, bit for bit
            assert got["grad_equal"], case


def test_cpu_and_non_fp32_codebooks_keep_the_torch_path():
    assert not lookup_triton.usable(torch.randn(1, 1, 4, 4))
    assert not lookup_triton.usable(torch.randn(1, 1, 4, 4, dtype=torch.bfloat16))
