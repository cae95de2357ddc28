"""GraphDecoder on the GPU (marked gpu): decode steps replayed from CUDA graphs over a static cache give the logits
of the same steps run eagerly over an identical static cache, and the eager QuantizedLoopKVCache's, at every step
across page boundaries (each graph replayed over several pages after its capture), with both RoPE styles and the
CUDA kernel reading the coded count on the device; greedy generation gives the eager cache's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_huginn, make_tiny_ouro
from support.decode import gen, lockstep, prefill
from support.quantizers import sampled_quantizer

from loopvq_calib.kernels import cuda_build
from loopvq_calib.serving.graph_decode import GraphDecoder
from loopvq_calib.serving.static_cache import StaticQuantizedLoopKVCache

pytestmark = pytest.mark.gpu
SERVING = dict(sink_tokens=4, recent_window=8, page_size=4)
STEPS = 22  # pages encoded at 4-step intervals: the first eagerly, the second captured, then replays


def case(name: str, dtype: torch.dtype):
    """A tiny model with head dim 64 (the CUDA kernel takes it) on the GPU in ``dtype``, a prompt (Ouro's row 1
    left-padded by 3), its mask and a sampled quantizer: Ouro TaSQ+LoopVQ (half RoPE), Huginn LoopVQ (interleaved)."""
    device = torch.device("cuda")
    if name == "ouro":
        model = make_tiny_ouro(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
        method, steps = "tasq+loopvq", 4
    else:
        model = make_tiny_huginn(n_embd=128, n_heads=2)
        method, steps = "loopvq", 2
    model = model.to(device=device, dtype=dtype)
    prompt = torch.randint(0, 4096, (2, 19), generator=gen(2)).to(device)
    mask = None
    if name == "ouro":
        mask = torch.ones_like(prompt)
        mask[1, :3] = 0
    q = sampled_quantizer(model, prompt, method, codebook_size=16, group_size=8, steps_per_block=steps)
    return model, prompt, mask, q


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def decoder(model, prompt, q, *, mask, graphs: bool) -> GraphDecoder:
    start, _ = prefill(model, prompt, q, mask=mask, backend="auto", **SERVING)
    static = StaticQuantizedLoopKVCache.from_cache(start, max_length=prompt.shape[1] + STEPS)
    return GraphDecoder(model, static, graphs=graphs)


@pytest.mark.parametrize(
    "name,dtype,same,tol",
    [("ouro", torch.float32, 1e-5, 1e-4), ("huginn", torch.float32, 1e-5, 1e-4), ("ouro", torch.bfloat16, 2e-2, 1e-1)],
)
def test_graph_replays_equal_eager_steps_across_pages(name, dtype, same, tol):
    """Replayed steps equal the same steps run eagerly over an identical static cache (the same kernels and
    buffers; within ``same``, relative L2: the matmuls may pick other algorithms on the capture stream) and stay
    within ``tol`` of the eager QuantizedLoopKVCache through the kernel (bf16: the kernels' rounding, amplified by a
    random network, a sanity bound); both graphs are captured and the regions follow the eager cache's."""
    model, prompt, mask, q = case(name, dtype)
    (eager, ids), (twin, _) = (prefill(model, prompt, q, mask=mask, backend="auto", **SERVING) for _ in range(2))
    graphed, plain = (decoder(model, prompt, q, mask=mask, graphs=g) for g in (True, False))
    runs = zip(
        lockstep(model, eager, graphed, ids=ids, steps=STEPS, mask=mask),
        lockstep(model, twin, plain, ids=ids, steps=STEPS, mask=mask),
    )
    for (want, got, eager_regions, regions), (_, plain_logits, _, _) in runs:
        assert relative(got, plain_logits) < same and relative(got, want) < tol
        assert regions == eager_regions
    assert set(graphed.graphs) == {False, True} and not plain.graphs
    assert graphed.cache.encoded - 4 >= 16 and graphed.cache.served_by_kernel  # 4+ pages during the steps
    if name == "ouro":  # the CUDA kernel served the graphs, reading the coded count on the device
        assert any(dict(key[1]).get("LIVE") == 1 for key in cuda_build.BUILDS._kernels)


@pytest.mark.parametrize("name", ["ouro", "huginn"])
def test_greedy_generation_gives_the_eager_caches_tokens(name):
    """20 greedy tokens from graph replays are the tokens of the eager QuantizedLoopKVCache's greedy loop."""
    model, prompt, mask, q = case(name, torch.float32)
    eager, ids = prefill(model, prompt, q, mask=mask, backend="auto", **SERVING)
    want, next_ids, grown = [], ids, mask
    with torch.inference_mode():
        for _ in range(20):
            kw = {}
            if grown is not None:
                grown = torch.cat([grown, grown.new_ones(2, 1)], 1)
                kw["attention_mask"] = grown
            next_ids = model(next_ids, cache=eager, use_cache=True, **kw).logits[:, -1:].argmax(-1)
            want.append(next_ids)
    graphed = decoder(model, prompt, q, mask=mask, graphs=True)
    assert torch.equal(graphed.greedy(ids, 20), torch.cat(want, 1))
    assert set(graphed.graphs) == {False, True}
