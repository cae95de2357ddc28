"""Reading a capture block by block, on disk (:class:`CaptureReader`: the shards of
:mod:`~loopvq_calib.calibration.capture.kv`, read lazily tensor by tensor) or in memory (:class:`MemoryReader`),
so that memory stays bounded by one block's data, never the whole capture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..tasq.stats import mean_query_stat, pair_spread
from .kv import CaptureError, MemoryCapture, shard_path


class CaptureData:
    """Reading a capture block by block (shared by the disk reader and the in-memory store)."""

    meta: dict[str, Any]

    def _tensors(self, seq: int, names: list[str]) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def _tensor(self, seq: int, name: str) -> torch.Tensor | None:
        return self._tensors(seq, [name])[0]

    @property
    def sink_tokens(self) -> int:
        """Leading tokens of each sequence kept in full precision (excluded from :meth:`load`)."""
        return self.meta["sink_tokens"]

    @property
    def num_sequences(self) -> int:
        """Calibration sequences in the capture."""
        return self.meta["num_sequences"]

    def load(
        self,
        name: str,
        sites: tuple[int, ...],
        sequences: list[int] | None = None,
        *,
        include_sinks: bool = False,
        device: torch.device | str | None = None,
        non_blocking: bool = False,
    ) -> torch.Tensor:
        """Tensor ``name`` (key | value | fisher_key | fisher_value) of ``sites`` -> [N, T, H, D] fp32 on ``device``.

        N runs over the tokens of ``sequences`` (default all), sinks excluded unless asked for. The data moves
        tensor by tensor in its storage dtype and is stacked and widened on the device. A Fisher stored in
        sums (over channel chunks, or RoPE pairs for TaSQ keys) is spread evenly back over its coordinates.
        ``non_blocking``: tensors in pinned host memory (an in-memory capture) are copied on the current stream
        without stopping the host; the caller keeps the capture until the device has read them.
        """
        start = 0 if include_sinks else self.sink_tokens
        names = [f"{name}.{s}" for s in sites]
        dev = torch.device(device or "cpu")
        parts = [  # each tensor goes to the device as read: no stacked or concatenated host copies
            torch.stack(
                [
                    t[start:].to(dev, non_blocking=non_blocking and dev.type == "cuda" and t.is_pinned())
                    for t in self._tensors(i, names)
                ],
                dim=1,
            )
            for i in (sequences if sequences is not None else range(self.num_sequences))
        ]
        out = torch.cat(parts)
        del parts  # the stored-dtype copies go before the float32 one is made
        out = out.float()
        c = self.meta.get("fisher_channels", 1)
        if name == "fisher_key" and self.tasq_keys:
            out = pair_spread(out, self.meta["kv_layout"]["rope_style"])
        elif name.startswith("fisher") and c > 1:
            out = out.repeat_interleave(c, dim=-1) / c
        return out

    @property
    def tasq_keys(self) -> bool:
        """The keys' Fisher is F / w^2 per RoPE pair (TaSQ methods): k-means multiplies it by sigma^2 only."""
        return self.meta.get("fisher_key") == "tasq_weighted_rope_pairs"

    def query_stats(self, site: int) -> torch.Tensor:
        """TaSQ's query statistic of ``site``, averaged over causal pairs and sequences -> [H, D]."""
        found = [t for i in range(self.num_sequences) if (t := self._tensor(i, f"qstat.{site}")) is not None]
        if not found:
            raise CaptureError(f"the capture holds no query statistics for site {site} (qstat.{site})")
        return mean_query_stat(found, self.meta["qstat_pairs_per_sequence"], self.num_sequences)

    def input_ids(self) -> torch.Tensor:
        """The captured sequences' token ids [n, S] on the CPU."""
        return torch.stack([self._tensor(i, "input_ids").cpu() for i in range(self.num_sequences)])


class CaptureReader(CaptureData):
    """A capture on disk (one safetensors file per sequence, read lazily tensor by tensor)."""

    def __init__(self, folder: Path) -> None:
        self.dir = Path(folder)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.files = [shard_path(self.dir, i) for i in range(self.meta["num_sequences"])]

    def _tensors(self, seq: int, names: list[str]) -> list[torch.Tensor | None]:
        try:
            with safe_open(str(self.files[seq]), framework="pt") as f:  # one open per sequence and call
                present = set(f.keys())
                return [f.get_tensor(n) if n in present else None for n in names]
        except Exception as err:  # missing, truncated or corrupted shard
            raise CaptureError(
                f"{self.files[seq]}: cannot be read ({type(err).__name__}: {err}); delete the "
                f"capture folder {self.dir} to capture again"
            ) from err


class MemoryReader(CaptureData):
    """Reads a :class:`MemoryCapture`."""

    def __init__(self, capture: MemoryCapture) -> None:
        self.capture = capture
        self.meta = capture.meta

    def _tensors(self, seq: int, names: list[str]) -> list[torch.Tensor | None]:
        stored = self.capture.sequences[seq]
        return [stored.get(n) for n in names]
