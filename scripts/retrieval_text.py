"""Recall text for the reference models: documents whose last words can only be answered from an earlier part of
the context, so a model that learns them answers from its KV cache, and a damaged cache shows in its answers.

Three kinds, each a ``prompt`` and an ``answer`` (a leading space, then the answer's text; a document is
``prompt + answer + "\\n"``):

- ``passkey``: the product's passkey prompt (:mod:`loopvq_calib.evaluation.passkey`: repeated filler, the needle
  at a random depth, "What is the pass key? The pass key is"), answer the five-digit key;
- ``registry``: a list of ``name = number`` lines, filler, then ``Look up NAME =``, answer the number;
- ``copy``: ``Remember this line: WORDS``, filler, then ``Repeat the line:``, answer the words.

The training scripts (``train_reference_model.py``, ``train_huginn_reference.py``) mix fresh documents into their
batches (:func:`recall_rows`, one packed row per draw, each row starting with a document); ``make_local_task.py``
builds the shipped lm-eval task from items of the same kinds drawn with another seed (:func:`task_item`);
:func:`recall_accuracy` scores a model's exact answers in full precision.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loopvq_calib.evaluation.passkey import FILLER as PASSKEY_FILLER, QUESTION as PASSKEY_QUESTION, needle

KINDS = ("passkey", "registry", "copy")
SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
    "The river runs to the sea.",
    "A quiet wind moves the trees.",
    "Nothing happens for a while.",
    "The road goes on and on.",
    "Birds sing in the morning.",
    "The night is long and still.",
    "A door opens and shuts.",
    "The hills are far away.",
    "Rain falls on the old roof.",
)
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pa", "se", "do", "fu", "gi", "ha", "ju", "be")
Tokenize = Callable[[str], list[int]]


def tokenize_with(tokenizer: Any) -> Tokenize:
    """``text -> ids`` of a transformers tokenizer, without special tokens."""
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class RecallItem:
    """One document: ``prompt``, then ``answer`` (leading space); the evidence is ``prompt[evidence_start:
    evidence_end]`` (filler before it, filler and the question after it)."""

    kind: str
    prompt: str
    answer: str
    evidence_start: int
    evidence_end: int


def word(rng: random.Random, syllables: int) -> str:
    """A pronounceable random word of ``syllables`` syllables."""
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables))


def filler_lines(rng: random.Random, sentences: int) -> str:
    """``sentences`` random filler sentences, four to a line, each line ending in a newline."""
    picked = [rng.choice(SENTENCES) for _ in range(sentences)]
    return "".join(" ".join(picked[i : i + 4]) + "\n" for i in range(0, sentences, 4))


def make_item(kind: str, rng: random.Random, *, before: int, after: int) -> RecallItem:
    """An item of ``kind`` with ``before`` / ``after`` filler units around the evidence (a unit is one filler
    sentence, or for ``passkey`` one repeat of the passkey filler)."""
    if kind == "passkey":
        key = str(rng.randint(10000, 99999))
        lead = PASSKEY_FILLER * before
        head = lead + needle(key)
        return RecallItem(kind, head + PASSKEY_FILLER * after + PASSKEY_QUESTION, f" {key}", len(lead), len(head))
    if kind == "registry":
        names = list(dict.fromkeys(word(rng, rng.randint(2, 3)) for _ in range(rng.randint(2, 8))))
        table = {n: str(rng.randint(10000, 99999)) for n in names}
        lead = filler_lines(rng, before)
        head = lead + "Registry:\n" + "".join(f"{n} = {v}\n" for n, v in table.items())
        query = rng.choice(names)
        return RecallItem(
            kind, head + filler_lines(rng, after) + f"Look up {query} =", f" {table[query]}", len(lead), len(head)
        )
    if kind == "copy":
        line = " ".join(word(rng, rng.randint(1, 3)) for _ in range(rng.randint(4, 8)))
        lead = filler_lines(rng, before)
        head = lead + f"Remember this line: {line}\n"
        return RecallItem(kind, head + filler_lines(rng, after) + "Repeat the line:", f" {line}", len(lead), len(head))
    raise ValueError(f"unknown kind {kind!r}; choose from {KINDS}")


def unit_tokens(tokenize: Tokenize) -> dict[str, float]:
    """Tokens per filler unit of each kind under ``tokenize`` (an estimate, for sizing items)."""
    sentences = len(tokenize(" ".join(SENTENCES))) / len(SENTENCES)
    return {"passkey": len(tokenize(PASSKEY_FILLER * 8)) / 8, "registry": sentences, "copy": sentences}


def training_item(kind: str, rng: random.Random, *, max_tokens: int, per_unit: dict[str, float]) -> RecallItem:
    """An item for training: a length drawn uniformly up to about ``max_tokens``, the evidence at a uniform depth."""
    units = int(rng.random() * max(0.0, max_tokens - 48) / per_unit[kind])
    before = rng.randint(0, units)
    return make_item(kind, rng, before=before, after=units - before)


def tokenizer_sample(rng: random.Random, *, count: int, max_tokens: int) -> list[str]:
    """``count`` recall documents of every kind in turn, for a tokenizer's training text (before any tokenizer
    exists, filler units are sized by a rough English BPE count)."""
    per_unit = {"passkey": 30.0, "registry": 8.0, "copy": 8.0}
    items = (training_item(KINDS[i % len(KINDS)], rng, max_tokens=max_tokens, per_unit=per_unit) for i in range(count))
    return [item.prompt + item.answer for item in items]


def recall_rows(tokenize: Tokenize, rng: random.Random, *, seq: int, eos: int) -> Iterator[np.ndarray]:
    """Endless training rows of ``seq`` token ids, each packed from fresh documents of every kind in turn
    (``prompt + answer + "\\n"``, then ``eos``), starting with a document; the last one is cut at the row's end."""
    per_unit = unit_tokens(tokenize)
    turn = 0
    while True:
        row: list[int] = []
        while len(row) < seq:
            item = training_item(KINDS[turn % len(KINDS)], rng, max_tokens=seq, per_unit=per_unit)
            turn += 1
            row += tokenize(item.prompt + item.answer + "\n") + [eos]
        yield np.asarray(row[:seq], dtype=np.int64)


def task_item(
    kind: str,
    rng: random.Random,
    tokenize: Tokenize,
    *,
    tokens: int,
    lead: int = 0,
    tail: int = 0,
    per_unit: dict[str, float] | None = None,
) -> RecallItem:
    """An item of at most ``tokens`` prompt tokens under ``tokenize`` whose evidence starts after at least ``lead``
    tokens and ends at least ``tail`` tokens before the question's end (so it lies outside sink tokens and a recent
    window of fewer tokens), at a uniform depth of what is left. ``per_unit``: :func:`unit_tokens` of
    ``tokenize`` when the caller has it."""
    per_unit = (per_unit or unit_tokens(tokenize))[kind]
    units = max(0, int((tokens - 48) / per_unit))
    min_before, min_after = int(np.ceil(lead / per_unit)), int(np.ceil(tail / per_unit))
    for _ in range(64):
        before = rng.randint(min_before, max(min_before, units - min_after))
        item = make_item(kind, rng, before=before, after=max(min_after, units - before))
        size = len(tokenize(item.prompt))
        ahead = len(tokenize(item.prompt[: item.evidence_start]))
        after = size - len(tokenize(item.prompt[: item.evidence_end]))
        if size <= tokens and ahead >= lead and after >= tail:
            return item
        min_before += ahead < lead
        min_after += after < tail
        units -= max(1, int((size - tokens) / per_unit) + 1) if size > tokens else 0
    raise ValueError(
        f"no {kind} item of at most {tokens} tokens with {lead} tokens before and {tail} after its evidence"
    )


@torch.no_grad()
def recall_accuracy(
    model: torch.nn.Module,
    tokenize: Tokenize,
    *,
    kind: str,
    tokens: int,
    items: int,
    tail: int = 128,
    answer_room: int = 24,
    context: Callable[[], Any] = contextlib.nullcontext,
) -> dict[str, Any]:
    """Exact-answer rate on ``items`` fresh items of ``kind`` of at most ``tokens`` tokens, answer included: every
    answer token must be the model's top prediction given the document so far (the tokens greedy decoding emits).
    ``context``: entered around the forwards (e.g. a Huginn model's seeded initial state)."""
    rng = random.Random(f"report-{kind}-{tokens}")
    per_unit, correct, sizes = unit_tokens(tokenize), 0, []
    with context():
        for _ in range(items):
            item = task_item(
                kind, rng, tokenize, tokens=tokens - answer_room, tail=min(tail, tokens // 4), per_unit=per_unit
            )
            ids = torch.tensor([tokenize(item.prompt + item.answer)])
            start = len(tokenize(item.prompt))
            logits = model(ids.to(model.device)).logits[0]
            correct += bool(torch.equal(logits[start - 1 : ids.shape[1] - 1].argmax(-1).cpu(), ids[0, start:]))
            sizes.append(ids.shape[1])
    return {
        "kind": kind,
        "max_tokens": tokens,
        "mean_tokens": round(sum(sizes) / items, 1),
        "items": items,
        "exact": correct / items,
    }
