"""The cache-side state of the decode kernels (serving/decode_state.py): the code buffer's growth and
layout, and the quantized cache decoding through the kernel against its reference path (Triton's interpreter on
CPU: ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE as DEVICE, make_tiny_huginn, make_tiny_ouro, needs_triton_kernels as needs_kernels
from support.decode import gen
from support.quantizers import sampled_quantizer

from loopvq_calib.codes.codec import Codes
from loopvq_calib.kernels import backends
from loopvq_calib.kernels.backends import BackendUnavailable
from loopvq_calib.serving.cache import QuantizedLoopKVCache
from loopvq_calib.serving.decode_state import CodeBuffer


def test_code_buffer_holds_every_page_head_major_and_doubles():
    """Pages (rows batch-major: b * page + token) land at consecutive tokens of each row; indices are stored
    head-major ([B, H, capacity, n] memory behind a [B, capacity, H, n] view); capacity doubles when full (64
    first), keeping the tokens written; sigmas follow the indices; a second sync copies only the new pages."""
    gen = torch.Generator().manual_seed(0)
    batch, page, heads, codes, steps = 2, 24, 3, 4, 2
    pages = [
        Codes(
            torch.randint(0, 256, (batch * page, heads, codes), generator=gen).to(torch.uint8),
            torch.rand(batch * page, steps, generator=gen).half(),
        )
        for _ in range(7)
    ]
    buf = CodeBuffer()
    capacities = []
    for i in range(1, len(pages) + 1):
        buf.sync(pages[:i], batch, page)
        capacities.append(buf.indices.shape[1])
    assert capacities == [64, 64, 96, 96, 192, 192, 192]  # max(2 * count, count + page, 64) when a page overflows
    assert buf.count == 7 * page and buf.pages == 7
    expect = torch.cat([p.indices.view(batch, page, heads, codes) for p in pages], 1)
    assert torch.equal(buf.indices[:, : buf.count], expect)
    assert torch.equal(buf.sigma[:, : buf.count], torch.cat([p.sigma.view(batch, page, steps) for p in pages], 1))
    cap = buf.indices.shape[1]
    assert buf.indices.stride() == (heads * cap * codes, codes, cap * codes, 1)  # head-major
    buf.sync(pages, batch, page)  # nothing new: nothing copied, nothing grown
    assert buf.count == 7 * page and buf.indices.shape[1] == cap


def test_code_buffer_copies_many_new_pages_at_once_as_one_by_one():
    """Many new pages in one sync (a prefill's, or a filled cache's), copied in chunks, give the contents and the
    capacity that page-by-page syncs give; a later page grows it as before."""
    gen = torch.Generator().manual_seed(1)
    batch, page, heads, codes, steps = 3, 8, 2, 5, 4
    pages = [
        Codes(
            torch.randint(0, 256, (batch * page, heads, codes), generator=gen).to(torch.uint8),
            torch.rand(batch * page, steps, generator=gen).half(),
        )
        for _ in range(21)
    ]
    one = CodeBuffer()
    for i in range(1, 21):
        one.sync(pages[:i], batch, page)
    bulk = CodeBuffer().sync(pages[:20], batch, page, chunk=3)
    assert (bulk.count, bulk.pages, bulk.indices.shape[1]) == (one.count, one.pages, one.indices.shape[1])
    assert (bulk.count, bulk.indices.shape[1]) == (160, 256)
    assert torch.equal(bulk.indices[:, :160], one.indices[:, :160])
    assert torch.equal(bulk.sigma[:, :160], one.sigma[:, :160])
    assert bulk.indices.stride() == one.indices.stride()
    for buf in (one, bulk):
        buf.sync(pages, batch, page)
    assert torch.equal(bulk.indices[:, :168], one.indices[:, :168]) and bulk.indices.shape[1] == 256


# -- the quantized cache through the kernel ---------------------------------------------------------------


def run_cache(model, batch, mask, quantizer, backend, new_tokens, **serving):
    """Prefill, then ``new_tokens`` greedy decode forwards (explicit calls, so the padding mask travels);
    returns the stacked last-position logits and the cache."""
    cache = QuantizedLoopKVCache(quantizer, backend=backend, **serving)
    kw = {} if mask is None else {"attention_mask": mask}
    out = model(batch.to(DEVICE), cache=cache, use_cache=True, **kw)
    logits = [out.logits[:, -1]]
    for _ in range(new_tokens):
        if mask is not None:
            kw["attention_mask"] = mask = torch.cat(
                [mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype, device=mask.device)], 1
            )
        out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True, **kw)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1), cache


@needs_kernels
@pytest.mark.slow  # about 40 s in the interpreter
def test_generate_through_the_kernel_gives_the_reference_tokens():
    """Ouro (half RoPE), TaSQ+LoopVQ, a left-padded batch: pages are encoded in prefill and during decoding;
    greedy tokens are identical with and without the kernel, logits within 1e-4 (float32 model)."""
    model = make_tiny_ouro().to(DEVICE)
    prompt = torch.randint(0, 4096, (2, 21), generator=gen(0))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    q = sampled_quantizer(model, prompt.to(DEVICE), "tasq+loopvq", codebook_size=16, group_size=8, steps_per_block=4)
    serving = dict(sink_tokens=4, recent_window=8, page_size=4)
    with_kernel, cache = run_cache(model, prompt, mask.to(DEVICE), q, "triton", 6, **serving)
    reference, plain = run_cache(model, prompt, mask.to(DEVICE), q, "torch", 6, **serving)
    assert cache.regions() == plain.regions() and cache.regions()["encoded"] == 12
    assert cache._kernel_state is not None and plain._kernel_state is None
    assert torch.equal(with_kernel.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(with_kernel, reference, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.slow
def test_huginn_cache_through_the_kernel():
    """Huginn (interleaved RoPE, single-site prelude/coda blocks, core blocks of 2 steps)."""
    model = make_tiny_huginn().to(DEVICE)
    prompt = torch.randint(0, 4096, (1, 14), generator=gen(1))
    q = sampled_quantizer(model, prompt.to(DEVICE), "loopvq", codebook_size=16, group_size=8, steps_per_block=2)
    serving = dict(sink_tokens=4, recent_window=4, page_size=4)
    with_kernel, cache = run_cache(model, prompt, None, q, "triton", 4, **serving)
    reference, _ = run_cache(model, prompt, None, q, "torch", 4, **serving)
    assert cache.regions()["encoded"] == 8
    assert torch.equal(with_kernel.argmax(-1), reference.argmax(-1))
    torch.testing.assert_close(with_kernel, reference, atol=1e-4, rtol=1e-4)


def test_cache_backend_choice(monkeypatch):
    """``auto`` leaves CPU tensors to the reference path; ``triton`` or ``cuda`` without a way to run refuse
    clearly at the first decode step; an unknown choice is refused at construction."""
    model = make_tiny_ouro()
    q = sampled_quantizer(model, torch.randint(0, 4096, (1, 16)), "cq", codebook_size=16, group_size=8)
    with pytest.raises(
        ValueError, match="QuantizedLoopKVCache backend: 'faiss' is not one of auto, cuda, triton, torch"
    ):
        QuantizedLoopKVCache(q, 4, 8, backend="faiss")
    cache = QuantizedLoopKVCache(q, 4, 8, backend="auto")
    model(torch.randint(0, 4096, (1, 12)), cache=cache, use_cache=True)
    model(torch.randint(0, 4096, (1, 1)), cache=cache, use_cache=True)
    assert cache._kernel_state is None
    monkeypatch.setattr(backends, "triton", None)
    for backend, reason in (("triton", "the triton package is not installed"), ("cuda", "device cpu is not CUDA")):
        strict = QuantizedLoopKVCache(q, 4, 8, backend=backend)
        model(torch.randint(0, 4096, (1, 12)), cache=strict, use_cache=True)
        with pytest.raises(BackendUnavailable, match=f"QuantizedLoopKVCache backend: '{backend}' needs .*{reason}"):
            model(torch.randint(0, 4096, (1, 1)), cache=strict, use_cache=True)
