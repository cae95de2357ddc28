"""A KV cache indexed by KV site (loop step, layer), usable with ``generate()``.

It avoids the two known bugs of the hub caches: it does not subclass transformers' ``Cache`` (whose
read-only ``key_cache`` properties broke the hub code), and it never computes mask sizes: the model
builds the mask from ``past_len + q_len`` itself (``common.build_context``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LoopKVCache:
    """Post-RoPE keys and values per site, each [B, S, H_kv, D], grown along S."""

    is_compileable = False  # read by generate() from a user-passed cache
    is_linear = (False,)

    def __init__(self, num_steps: int | None = None) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.num_steps = num_steps  # loop count the cache was filled with (Huginn may vary it)
        self._is_user_defined = False

    def update(
        self,
        site: int,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        positions: torch.Tensor,
        rope: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this call's pre-RoPE ``key`` (rotated here) and ``value``; return the whole site."""
        key = rope(key, positions)
        if site in self.keys:
            key = torch.cat([self.keys[site], key], dim=1)
            value = torch.cat([self.values[site], value], dim=1)
        self.keys[site], self.values[site] = key, value
        return key, value

    def check_steps(self, num_steps: int) -> None:
        """Refuse to mix loop counts in one cache: the site ids of later blocks depend on it."""
        if self.num_steps is None:
            self.num_steps = num_steps
        elif self.num_steps != num_steps:
            raise ValueError(
                f"this cache was filled with {self.num_steps} loop steps; a forward with {num_steps} "
                "would read other sites. Use one loop count per cache."
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached so far (every site holds the same number; ``layer_idx`` is ignored)."""
        if not self.keys:
            return 0
        return self.keys[min(self.keys)].shape[1]

    def __len__(self) -> int:
        return len(self.keys)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch for beam search."""
        for store in (self.keys, self.values):
            for site, t in store.items():
                store[site] = t.index_select(0, beam_idx.to(t.device))

    def nbytes(self) -> int:
        """Bytes held by the cached tensors."""
        return sum(t.numel() * t.element_size() for s in (self.keys, self.values) for t in s.values())
