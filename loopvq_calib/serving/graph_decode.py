"""Greedy decode steps replayed from CUDA graphs over a static cache.

:class:`GraphDecoder` runs the model's forward for one new token per sequence over a cache of fixed shapes
(:class:`~loopvq_calib.serving.static_cache.StaticQuantizedLoopKVCache`), from static inputs: the token ids
(copied in before each step) and the positions (advanced by the step itself). A step comes in two kinds, the
plain one and the one whose last site encodes a page (every ``page_size`` steps); each kind is captured in a
``torch.cuda.CUDAGraph`` the second time it comes (the first runs eagerly: it builds the kernels, runs their
probes, makes the step tables, the RoPE table and the kernels' counters, none of which a capture may do) on the
decoder's own stream, and replayed from then on. Which kind a step is, the host knows from the cache's mirrors
(:meth:`~loopvq_calib.serving.static_cache.StaticQuantizedLoopKVCache.page_due`), without reading the device.
Off CUDA, or with ``graphs=False``, every step runs eagerly through the same code.

The cache protocol it needs: ``batch``, ``device``, ``page_due()``, ``next_positions()``,
``capturing(encode=)`` and ``replayed(encode=)``, beside the models' ``attend`` / ``get_seq_length`` /
``check_steps``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GraphDecoder:
    """Decode steps of ``model`` over ``cache`` (module docstring); ``forward`` holds extra keyword arguments of
    the model's forward (Huginn's ``num_steps``)."""

    def __init__(
        self, model: torch.nn.Module, cache: Any, *, forward: dict[str, Any] | None = None, graphs: bool = True
    ) -> None:
        self.model, self.cache, self.forward = model, cache, dict(forward or {})
        self.graphs_on = graphs and cache.device.type == "cuda"
        with torch.inference_mode():
            self.ids = torch.zeros(cache.batch, 1, dtype=torch.long, device=cache.device)
            self.positions = cache.next_positions()
        self.stream = torch.cuda.Stream(cache.device) if self.graphs_on else None
        self.graphs: dict[bool, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # encodes a page -> graph, logits
        self._ran: set[bool] = set()

    @torch.inference_mode()
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of the token after ``ids`` [B, 1]. From a graph they are its output tensor, which the next
        step overwrites: keep a copy to hold them longer."""
        due = self.cache.page_due()
        self.ids.copy_(ids)
        if self.graphs_on and due in self._ran and due not in self.graphs:
            self._capture(due)
        if due in self.graphs:
            graph, logits = self.graphs[due]
            graph.replay()
            self.cache.replayed(encode=due)
            return logits
        self._ran.add(due)
        return self._on_stream(self._forward)

    def greedy(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """``new_tokens`` greedy tokens [B, new_tokens] after ``ids`` [B, 1] (the prefill's last choice)."""
        out = []
        for _ in range(new_tokens):
            ids = self.step(ids).argmax(-1, keepdim=True)
            out.append(ids)
        return torch.cat(out, 1)

    def _forward(self) -> torch.Tensor:
        """The step: the model's forward from the static inputs, then the positions advanced."""
        out = self.model(self.ids, position_ids=self.positions, cache=self.cache, use_cache=True, **self.forward)
        self.positions.add_(1)
        return out.logits[:, -1]

    def _on_stream(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run`` on the capture stream (eager steps warm up where the graphs are captured)."""
        if self.stream is None:
            return run()
        current = torch.cuda.current_stream(self.cache.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = run()
        current.wait_stream(self.stream)
        return out

    def _capture(self, encode: bool) -> None:
        """Capture one step of kind ``encode`` (nothing runs; the cache's host mirrors are left as they were)."""
        graph = torch.cuda.CUDAGraph()
        with self.cache.capturing(encode=encode):
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                logits = self._forward()
        self.graphs[encode] = (graph, logits)
