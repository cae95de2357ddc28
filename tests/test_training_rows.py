"""scripts/training_rows.py: training batches with rows of other streams, and rows of repeated random spans."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from conftest import load_script

rows = load_script("training_rows")


def spans_of(row: np.ndarray, low: int, high: int) -> list[int]:
    """Lengths of the spans a row is packed from, found by reading it: at each start the one length L in
    [low, high] whose next L tokens repeat the L before them (random ids make two such lengths improbable)."""
    found, i = [], 0
    while i < len(row):
        fits = [
            n
            for n in range(low, high + 1)
            if i + 2 * n <= len(row) and (row[i : i + n] == row[i + n : i + 2 * n]).all()
        ]
        if not fits:  # the cut last span: its second copy starts the same way as its first
            rest = len(row) - i
            n = next(
                n for n in range(max(low, (rest + 1) // 2), high + 1) if (row[i + n :] == row[i : rest - n + i]).all()
            )
            return found + [n]
        assert len(fits) == 1
        found.append(fits[0])
        i += 2 * fits[0]
    return found


def test_repeat_rows_pack_spans_each_followed_by_itself():
    stream = rows.repeat_rows(np.random.default_rng(0), seq=512, vocab=100, spans=(16, 40))
    for row in itertools.islice(stream, 4):
        assert row.shape == (512,) and row.dtype == np.int64
        assert row.min() >= 3 and row.max() < 100  # no special token, inside the vocabulary
        lengths = spans_of(row, 16, 40)
        assert all(16 <= n <= 40 for n in lengths) and len(set(lengths)) > 1


def test_batches_put_each_streams_rows_last_in_order_and_text_windows_first():
    text = np.arange(1000, dtype=np.uint16)
    a = itertools.repeat(np.full(8, -1, dtype=np.int64))
    b = itertools.repeat(np.full(8, -2, dtype=np.int64))
    batch = next(rows.batches(text, 8, 6, gen=torch.Generator().manual_seed(0), extra=[(a, 2), (b, 1)]))
    assert batch.shape == (6, 8)
    for window in batch[:3]:  # consecutive token ids of the text at some start
        assert torch.equal(window, torch.arange(int(window[0]), int(window[0]) + 8))
    assert (batch[3:5] == -1).all() and (batch[5] == -2).all()
