"""Synthetic needle-in-a-haystack retrieval: a passkey hidden in filler text, asked for at the end.

The prompt follows the passkey test of Mohtashami & Jaggi (arXiv:2305.16300): repeated filler sentences,
"The pass key is NNNNN. Remember it. NNNNN is the pass key." at a random depth, then "What is the pass
key? The pass key is". A trial counts when the greedy continuation's first number equals the key. Every
entry is served through its own cache (sinks, encoded pages, recent window), so at lengths beyond the
window the needle is read from encoded pages.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import torch

from .harness import ServedLM

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is"
NEW_TOKENS = 8


@dataclass
class Trial:
    """One passkey prompt."""

    length: int  # prompt tokens
    key: str
    depth: float  # where the needle sits, as a fraction of the filler
    prompt: str


def needle(key: str) -> str:
    """The sentences that hide ``key`` in the filler."""
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def make_trials(tokenizer: Any, lengths: list[int], trials: int, *, seed: int = 0) -> list[Trial]:
    """``trials`` prompts per length, each at most ``length`` tokens (the longest filler that fits)."""
    rng = random.Random(seed)
    out = []

    def size(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    filler_tokens = size(FILLER * 8) / 8
    for length in lengths:
        for _ in range(trials):
            key, depth = str(rng.randint(10000, 99999)), rng.random()
            fixed = size(needle(key) + QUESTION)
            n = max(int((length - fixed) / filler_tokens) + 2, 0)  # an estimate from above
            while n > 0 and size(_prompt(key, depth, n)) > length:
                n -= 1
            out.append(Trial(length, key, depth, _prompt(key, depth, n)))
    return out


def _prompt(key: str, depth: float, repeats: int) -> str:
    before = round(repeats * depth)
    return FILLER * before + needle(key) + FILLER * (repeats - before) + QUESTION


def answered(continuation: str, key: str) -> bool:
    """True when the first number in the continuation is the key."""
    found = re.search(r"\d+", continuation)
    return found is not None and found.group(0) == key


@torch.no_grad()
def run_passkey(
    model: torch.nn.Module, tokenizer: Any, entries: list[Any], *, lengths: list[int], trials: int, seed: int = 0
) -> dict[str, Any]:
    """Accuracy per prompt length for each entry (:class:`~loopvq_calib.evaluation.served.Entry`), on the same
    trials; lengths whose prompts and answers exceed the model's window raise ValueError."""
    window = model.window
    too_long = [n for n in lengths if n + NEW_TOKENS > window]
    if too_long:
        raise ValueError(
            f"--passkey-lengths {too_long}: prompts plus {NEW_TOKENS} new tokens exceed the model's "
            f"window of {window} tokens"
        )
    cases = make_trials(tokenizer, lengths, trials, seed=seed)
    acc: dict[str, dict[str, float]] = {}
    for e in entries:
        lm = ServedLM(model, tokenizer, e.make_cache(), seed=seed)
        hits: dict[int, int] = {n: 0 for n in lengths}
        for c in cases:
            hits[c.length] += answered(lm.greedy([c.prompt], [], NEW_TOKENS)[0], c.key)
        acc[e.name] = {str(n): hits[n] / trials for n in lengths}
    return {"lengths": lengths, "trials_per_length": trials, "seed": seed, "accuracy": acc}
