"""A quantization method registered here alone runs through the whole toolkit: calibrate -> bundle -> load_bundle ->
served decode. The toy is a loop-axis method with a layout rule of its own (strided channels), declared with
``register_method`` and a ``LOOP_LAYOUTS`` entry, both undone after the test; no module of the package changes. A
method that declares no fused decode is served by the cache's reference path."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_quantizer
from support.builders import tiny_config

from loopvq_calib import QuantizedLoopKVCache, calibrate, load_bundle
from loopvq_calib.codes import layouts
from loopvq_calib.codes.objective import teacher
from loopvq_calib.config.methods import QuantMethod, register_method, unregister_method
from loopvq_calib.kernels.backends import BackendUnavailable
from loopvq_calib.models.loading import load_model

TOY = QuantMethod("toyvq", loop_layout="strided")


def strided_groups(head_dim: int, steps: int, group_size: int) -> torch.Tensor:
    """Group g holds channels g, g + n, g + 2n, ... (n = D / c) at every step; coordinate i * T + m of a code is
    channel i of the group at step m -> [n, G]."""
    c = group_size // steps
    n = head_dim // c
    return torch.tensor([[m * head_dim + g + n * i for i in range(c) for m in range(steps)] for g in range(n)])


@pytest.fixture
def toy_method(monkeypatch):
    monkeypatch.setitem(layouts.LOOP_LAYOUTS, TOY.loop_layout, strided_groups)
    register_method(TOY)
    yield TOY
    unregister_method(TOY.name)


def by_hand(x: torch.Tensor, groups: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """decode(encode(x)) of a block without TaSQ, written out: x [N, T, H, D], groups [1, n, G], codebook
    [H, n, K, G] -> each group vector replaced by its nearest codeword."""
    n, t, h, d = x.shape
    flat = x.permute(0, 2, 1, 3).reshape(n, h, t * d)  # coordinate m * D + channel
    vectors = flat[:, :, groups[0]]  # [N, H, n, G]
    nearest = torch.cdist(vectors.permute(1, 2, 0, 3), codebook).argmin(-1)  # [H, n, N]
    chosen = torch.gather(codebook, 2, nearest[..., None].expand(-1, -1, -1, codebook.shape[-1]))  # [H, n, N, G]
    out = torch.empty_like(flat)
    out[:, :, groups[0]] = chosen.permute(2, 0, 1, 3)
    return out.view(n, h, t, d).permute(0, 2, 1, 3)


def test_a_toy_method_runs_from_calibration_to_served_decode(toy_method, tiny_ouro_dir, calib_corpus, tmp_path):
    cfg = tiny_config(
        tiny_ouro_dir, calib_corpus, tmp_path / "run", quant={"method": toy_method.name}, finetune={"epochs": 1}
    )
    result = calibrate(cfg)
    bundle = load_bundle(result.bundle)
    q = bundle.quantizer
    assert bundle.meta["method"] == q.method == toy_method.name
    expected = strided_groups(16, 4, 8)
    assert not torch.equal(expected, layouts.loop_axis_groups(16, 4, 8))  # the rule differs from LoopVQ's
    assert {len(c.layout.sites) for c in q.codecs.values()} == {4}  # one block of the 4 loop steps per layer
    assert all(torch.equal(c.layout.groups, expected[None]) for c in q.codecs.values())

    model, _ = load_model(tiny_ouro_dir, "float32", torch.device("cpu"))
    prompt = torch.randint(0, 4096, (1, 40), generator=torch.Generator().manual_seed(5))
    caches = {
        store: QuantizedLoopKVCache(q, sink_tokens=8, recent_window=16, page_size=8, store=store)
        for store in ("indices", "fake")
    }
    prefill = {store: model(prompt, cache=cache, use_cache=True).logits for store, cache in caches.items()}
    cache = caches["indices"]
    assert cache.regions() == {"sink": 8, "encoded": 16, "window": 16}
    fp = teacher(model, prompt)
    for codec in q.codecs.values():
        lay = codec.layout
        source = fp.keys if lay.kind == "key" else fp.values
        block = torch.stack([source[site][0, 8:24] for site in lay.sites], dim=1)  # encoded tokens [16, T, H, D]
        want = by_hand(block, lay.groups, codec.codebook.float())
        for m, site in enumerate(lay.sites):
            got = cache.site_kv(site)[0 if lay.kind == "key" else 1][0, 8:24]
            torch.testing.assert_close(got, want[:, m], rtol=1e-5, atol=1e-5)
    token = prefill["indices"][:, -1:].argmax(-1)
    assert cache.decode_backend(torch.zeros(1, 1, 4, 16)) is None  # on the CPU the reference path serves it
    step = {store: model(token, cache=c, use_cache=True).logits for store, c in caches.items()}  # from the codes
    full = model(torch.cat([prompt, token], 1)).logits[:, -1:]
    torch.testing.assert_close(step["indices"], step["fake"], rtol=1e-5, atol=1e-5)
    assert (step["indices"] - full).abs().max() > 1e-3  # the encoded tokens do change the step


def test_a_method_without_fused_decode_is_served_by_the_reference_path(tiny_ouro_dir):
    slow = register_method(QuantMethod("toyslow", loop_layout="loop-axis", fused_decode=False))
    try:
        q = tiny_quantizer(tiny_ouro_dir, method=slow.name)
        assert not q.fused_decode and tiny_quantizer(tiny_ouro_dir, method="loopvq").fused_decode
        query = torch.zeros(1, 1, 4, 16)
        for backend in ("cuda", "triton"):  # refused before any device or kernel is looked at
            with pytest.raises(BackendUnavailable, match=f"backend='{backend}' reads LoopVQ codes; KVQuantizer has"):
                QuantizedLoopKVCache(q, 8, 16, backend=backend).decode_backend(query)
        assert (
            QuantizedLoopKVCache(q, 8, 16).decode_backend(query.cuda() if torch.cuda.is_available() else query) is None
        )
    finally:
        unregister_method(slow.name)
