"""The fused codeword-lookup kernel against the torch path of ``BlockCodec.decode``: the same values (exact
copies) and, through the codec's ``fused_lookup``, the same codebook gradient; its probe.

The kernel runs on a CUDA GPU, or on CPU tensors in Triton's interpreter: without a GPU the comparison runs
in a child process with ``TRITON_INTERPRET=1`` (the variable has to be set before triton is imported).
Without triton the kernel tests are skipped."""

from __future__ import annotations

import pytest
import torch
from conftest import run_kernel_script

from loopvq_calib.kernels import lookup as lookup_kernel
from loopvq_calib.kernels.backends import triton

needs_triton = pytest.mark.skipif(triton is None, reason="needs triton")

COMPARE = r"""
import json, sys, torch
from loopvq_calib.kernels import lookup as lookup_kernel
from loopvq_calib.codes.codec import BlockCodec, fused_lookup
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
    layout = BlockLayout("b", "key", tuple(range(steps)), d, h, groups)
    codec = BlockCodec(layout, torch.randn(hc, nc, k, g, generator=gen))
    codes = codec.encode(torch.randn(n, steps, h, d, generator=gen))
    weight = torch.randn(n, steps, h, d, generator=gen)
    codec.codebook.requires_grad_(True)
    want = codec.decode(codes)  # CPU tensors: the torch path
    (want * weight).sum().backward()
    to_groups, to_block = (t.to(device) for t in codec.permutation(h, d, torch.device("cpu")))
    book = codec.codebook.detach().to(device).requires_grad_(True)
    got = fused_lookup(book, codes.indices.to(device), to_block, to_groups=to_groups, steps=steps, head_dim=d)
    (got * weight.to(device)).sum().backward()
    grad = book.grad.cpu()
    plain = lookup_kernel.lookup_block(codes.indices.to(device), book.detach(), to_block, steps=steps, head_dim=d)
    out[str(case)] = {"values": torch.equal(got.detach().cpu(), want.detach()), "shape": list(got.shape),
                      "kernel_values": torch.equal(plain.cpu(), want.detach()),
                      "grad_equal": torch.equal(grad, codec.codebook.grad),
                      "grad_close": torch.allclose(grad, codec.codebook.grad, rtol=1e-5, atol=1e-5)}
lookup_kernel.probe(device)  # compiles, runs and copies the reference's values: no error
real = lookup_kernel.lookup_block
lookup_kernel.lookup_block = lambda *args, **kwargs: real(*args, **kwargs) * 1.001
try:
    lookup_kernel.probe(device)
    out["wrong_kernel"] = "passed"
except RuntimeError as err:
    out["wrong_kernel"] = str(err)
print(json.dumps(out))
"""


@needs_triton
def test_kernel_copies_the_torch_paths_codewords_and_gradient():
    out = run_kernel_script(COMPARE)
    assert out.pop("wrong_kernel") == "it does not copy the torch reference's values"
    assert len(out) == 4
    for case, got in out.items():
        n, steps, h, d = eval(case)[:4]
        assert got["values"] and got["kernel_values"] and got["shape"] == [n, steps, h, d], case
        assert got["grad_close"], case
        if not torch.cuda.is_available():  # CPU: the same index_add_ as the torch path's backward, bit for bit
            assert got["grad_equal"], case


def test_the_probes_reference_places_codewords_in_block_order():
    """reference(): code (h, group) of a token picks its codebook row, shared heads broadcast, and block coordinate
    f reads group element to_block[f] (worked by hand: 1 token, 2 heads x 1 group of G 2, K 2, one step of D 2)."""
    codebook = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # shared by both heads
    indices = torch.tensor([[[1], [0]]])  # head 0 -> codeword 1, head 1 -> codeword 0: group order 3, 4, 1, 2
    to_block = torch.tensor([2, 0, 3, 1])  # block (head 0: 1, 3; head 1: 2, 4)
    got = lookup_kernel.reference(indices, codebook, to_block, steps=1, head_dim=2)
    assert got.tolist() == [[[[1.0, 3.0], [2.0, 4.0]]]]


def test_only_fp32_codebooks_on_cuda_are_candidates():
    cpu = lookup_kernel.candidate(torch.device("cpu"), torch.float32)
    assert not cpu.auto and cpu.unfit() == ""
    assert (
        lookup_kernel.candidate(torch.device("cpu"), torch.bfloat16).unfit()
        == "a torch.bfloat16 codebook (it reads float32)"
    )
