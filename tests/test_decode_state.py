"""The cache-side state of the decode kernels (loopvq_calib/decode_state.py): the code buffer's growth and
layout."""

from __future__ import annotations

import torch

from loopvq_calib.codec import Codes
from loopvq_calib.decode_state import CodeBuffer


def test_code_buffer_holds_every_page_head_major_and_doubles():
    """Pages (rows batch-major: b * page + token) land at consecutive tokens of each row; indices are stored
    head-major ([B, H, capacity, n] memory behind a [B, capacity, H, n] view); capacity doubles when full (64
    first), keeping the tokens written; sigmas follow the indices; a second sync copies only the new pages."""
    gen = torch.Generator().manual_seed(0)
    batch, page, heads, codes, steps = 2, 24, 3, 4, 2
    pages = [Codes(torch.randint(0, 256, (batch * page, heads, codes), generator=gen).to(torch.uint8),
                   torch.rand(batch * page, steps, generator=gen).half()) for _ in range(7)]
    buf = CodeBuffer()
    capacities = []
    for i in range(1, len(pages) + 1):
        buf.sync(pages[:i], batch, page)
        capacities.append(buf.indices.shape[1])
    assert capacities == [64, 64, 96, 96, 192, 192, 192]  # max(2 * count, count + page, 64) when a page overflows
    assert buf.count == 7 * page and buf.pages == 7
    expect = torch.cat([p.indices.view(batch, page, heads, codes) for p in pages], 1)
    assert torch.equal(buf.indices[:, :buf.count], expect)
    assert torch.equal(buf.sigma[:, :buf.count], torch.cat([p.sigma.view(batch, page, steps) for p in pages], 1))
    cap = buf.indices.shape[1]
    assert buf.indices.stride() == (heads * cap * codes, codes, cap * codes, 1)  # head-major
    buf.sync(pages, batch, page)  # nothing new: nothing copied, nothing grown
    assert buf.count == 7 * page and buf.indices.shape[1] == cap
