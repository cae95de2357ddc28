"""CUDA-graph decode steps for benchmarks/decode/bench_decode_model.py: timing a
:class:`~loopvq_calib.serving.graph_decode.GraphDecoder`, the bf16 baseline it replays (:class:`StaticBf16Cache`),
the kernel-modelled tokens/s of benchmarks/decode/bench_decode.py's results, and a profile of the step's kernels.

The bf16 baseline is what transformers' static cache under ``torch.compile`` does for a plain model: post-RoPE keys
and values in buffers of fixed capacity, the new token written at a device-side index, SDPA over the whole capacity
under a mask of the tokens held; replayed from a CUDA graph by the same decoder as the coded cache.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from loopvq_calib.models.common import sdpa
from loopvq_calib.serving.graph_decode import GraphDecoder

KINDS = (  # kernel name fragments -> what the profile calls them, first match wins
    ("loopvq_decode_split", "decode attention (CUDA)"),
    ("_split_kernel", "decode attention (Triton)"),
    ("_merge_kernel", "decode attention (Triton)"),
    ("fmha", "SDPA"),
    ("flash", "SDPA"),
    ("attention", "SDPA"),
    ("_nearest_kernel", "page encode"),
    ("gemm", "matmul"),
    ("nvjet", "matmul"),
    ("cutlass", "matmul"),
    ("xmma", "matmul"),
    ("norm", "norms"),
    ("index", "cache writes"),
)


class StaticBf16Cache:
    """The bf16 baseline (module docstring): ``keys`` / ``values`` [B, capacity, H, D] per site, post-RoPE, the first
    ``length`` filled; the static-cache protocol of :class:`~loopvq_calib.serving.graph_decode.GraphDecoder`."""

    def __init__(
        self, kv: Any, *, batch: int, length: int, max_length: int, device: torch.device, gen: torch.Generator
    ) -> None:
        self.batch, self.device, self.length, self.max_length = batch, device, length, max_length
        capacity = -(-max_length // 16) * 16  # SDPA's masked kernels want an aligned mask row
        shape = (batch, capacity, kv.kv_heads, kv.head_dim)
        self.keys, self.values = {}, {}
        for s in kv.sites:
            for store in (self.keys, self.values):
                store[s.site] = torch.zeros(shape, dtype=torch.bfloat16, device=device)  # masked, but finite
                store[s.site][:, :length].normal_(generator=gen)
        self.first_site, self.last_site = min(self.keys), max(self.keys)
        self.tokens = torch.full((1,), length, dtype=torch.long, device=device)
        self._slots = torch.arange(capacity, device=device)
        self._mask: torch.Tensor | None = None

    def attend(self, site: int, q: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor, ctx: Any) -> torch.Tensor:
        if site == self.first_site:
            self._mask = (self._slots <= self.tokens)[None, None, None, :]
        self.keys[site].index_copy_(1, self.tokens, ctx.rope(key, ctx.positions))
        self.values[site].index_copy_(1, self.tokens, value)
        if site == self.last_site:
            self.tokens.add_(1)
            self.length += 1
        return sdpa(q, self.keys[site], self.values[site], mask=self._mask)

    def page_due(self) -> bool:
        if self.length >= self.max_length:
            raise ValueError(f"the bf16 static cache holds {self.max_length} tokens")
        return False

    def next_positions(self) -> torch.Tensor:
        return self.tokens.expand(self.batch)[:, None].clone()

    @contextmanager
    def capturing(self, *, encode: bool) -> Iterator[None]:
        held = self.length
        try:
            yield
        finally:
            self.length = held

    def replayed(self, *, encode: bool) -> None:
        self.length += 1

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def check_steps(self, num_steps: int) -> None:
        """Any loop count: the sites exist for the model's own."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store.values())


@torch.inference_mode()
def time_graph_steps(decoder: GraphDecoder, ids: torch.Tensor, *, warmup: int, steps: int, kinds: int) -> list[float]:
    """Milliseconds of ``steps`` greedy steps after at least ``warmup`` untimed ones and until the decoder holds
    ``kinds`` graphs (plain, and page-encoding for a coded cache; none off CUDA)."""
    done = 0
    while done < warmup or (decoder.graphs_on and len(decoder.graphs) < kinds):
        ids = decoder.step(ids).argmax(-1, keepdim=True)
        done += 1
    if ids.device.type != "cuda":
        out = []
        for _ in range(steps):
            start = time.perf_counter()
            ids = decoder.step(ids).argmax(-1, keepdim=True)
            out.append((time.perf_counter() - start) * 1e3)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        ids = decoder.step(ids).argmax(-1, keepdim=True)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def warmup_bound(warmup: int, page_size: int) -> int:
    """Steps :func:`time_graph_steps` may run before timing: both kinds of step twice (page-encoding every
    ``page_size`` steps)."""
    return max(warmup, 2 * page_size + 2)


def kernel_model(path: Path | None) -> dict[str, Any]:
    """Whole-model tokens/s that bench_decode.py models from its kernel times (batch / (body + sites x attention),
    the body a CUDA graph of the weight matmuls), per "context,batch,method" ("bf16": its SDPA, from the first
    method's run), with the file and its machine; empty when there is no file."""
    if path is None or not path.is_file():
        return {}
    stored = json.loads(path.read_text())
    cases = {}
    for r in stored["cases"]:
        cases[f"{r['context']},{r['batch']},{r['method']}"] = r["coded_tokens_per_s"]
        cases.setdefault(f"{r['context']},{r['batch']},bf16", r["bf16_tokens_per_s"])  # each method's run has one
    return {"file": str(path.name), "device": stored["device"], "commit": stored["commit"], "tokens_per_s": cases}


def modelled(model: dict[str, Any], context: int, batch: int, *, cache: str) -> float | None:
    """The kernel-modelled tokens/s of ``cache`` (a --caches name; its -graph variant the same) at (context, batch)."""
    return model.get("tokens_per_s", {}).get(f"{context},{batch},{cache.removesuffix('-graph')}")


@torch.inference_mode()
def profile_steps(step: Callable[[], Any], steps: int) -> dict[str, Any]:
    """GPU kernel time of ``steps`` calls of ``step`` per step, by kind (:data:`KINDS`) and the 12 longest kernels,
    with each call's wall time (CUDA events)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    kernels = []
    for e in prof.key_averages():
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        if not us or e.key.startswith(("cudaGraphLaunch", "Memcpy", "Memset")):
            continue
        kind = next((label for part, label in KINDS if part in e.key), "other elementwise")
        by_kind[kind] += us / 1e3 / steps
        kernels.append((us / 1e3 / steps, e.count / steps, e.key[:90]))
    kernels.sort(reverse=True)
    return {
        "steps": steps,
        "wall_ms": statistics.fmean(s.elapsed_time(e) for s, e in events),
        "kernel_ms": sum(by_kind.values()),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"ms": ms, "calls": calls, "name": name} for ms, calls, name in kernels[:12]],
    }
