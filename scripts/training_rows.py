"""Training batches of the reference-model scripts (train_reference_model.py, train_huginn_reference.py): windows
of the training text, with rows from other streams (recall documents, repeated random spans) in their place."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch


def batches(
    tokens: np.ndarray,
    seq: int,
    batch: int,
    *,
    gen: torch.Generator,
    extra: Sequence[tuple[Iterator[np.ndarray], int]] = (),
) -> Iterator[torch.Tensor]:
    """Endless training batches [batch, seq] of text windows at random starts (drawn from ``gen``), of which the
    last rows come from ``extra``: ``rows`` rows from each ``(iterator, rows)`` pair, in order."""
    data = torch.from_numpy(tokens.astype(np.int64))
    text_rows = batch - sum(rows for _, rows in extra)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (text_rows,), generator=gen)
        rows = [data[s : s + seq] for s in starts]
        rows += [torch.from_numpy(next(it)) for it, n in extra for _ in range(n)]
        yield torch.stack(rows)


def repeat_rows(
    rng: np.random.Generator, *, seq: int, vocab: int, first_id: int = 3, spans: tuple[int, int] = (16, 256)
) -> Iterator[np.ndarray]:
    """Endless rows of ``seq`` token ids packed from random token spans, each followed by itself (span lengths
    uniform in ``spans``; ids from ``first_id`` up, past the three special tokens of both reference tokenizers):
    every second copy is predictable only by reading the first back, the in-context copying that recall rests on."""
    while True:
        row: list[np.ndarray] = []
        size = 0
        while size < seq:
            span = rng.integers(first_id, vocab, int(rng.integers(spans[0], spans[1] + 1)))
            row += [span, span]
            size += 2 * len(span)
        yield np.concatenate(row)[:seq].astype(np.int64)
