"""Build the shipped local lm-eval task ``loopvq_recall``: exact recall from the KV cache.

240 items, 80 of each kind of ``retrieval_text.py`` (a pass key in filler, a registry looked up later, a line
repeated later), drawn with their own seed (the reference models train on fresh items of the same kinds, never on
these). Every item fits in ``LENGTHS`` prompt tokens under each shipped reference model's tokenizer (20 items per
kind and length, in rounds of one item per kind and length, so that ``--limit 12n`` takes n of each), its evidence
starts after ``LEAD`` tokens (past the sink tokens) and ends at least ``TAIL`` tokens before the question's end
(outside the recent window), and its answer is several tokens long, so that all but its first token are decoded
from the coded cache.
Command: ``python scripts/make_local_task.py`` (rewrites the task's jsonl).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from retrieval_text import KINDS, task_item, tokenize_with, unit_tokens
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
MODELS = (ROOT / "artifacts" / "tiny-ouro", ROOT / "artifacts" / "tiny-huginn")
OUT = ROOT / "loopvq_calib" / "evaluation" / "tasks" / "loopvq_recall" / "recall.jsonl"
LENGTHS = (256, 512, 1024, 1536)
PER_LENGTH = 20
LEAD, TAIL = 16, 128
SEED = "loopvq_recall-v1"


def tokenizers() -> list:
    """``text -> ids`` of each shipped reference model's tokenizer."""
    return [tokenize_with(AutoTokenizer.from_pretrained(folder)) for folder in MODELS]


def fits(item, tokenize, *, tokens: int) -> bool:
    """Whether ``item`` keeps the task's bounds under ``tokenize``."""
    size = len(tokenize(item.prompt))
    return (
        size <= tokens
        and len(tokenize(item.prompt[: item.evidence_start])) >= LEAD
        and size - len(tokenize(item.prompt[: item.evidence_end])) >= TAIL
        and len(tokenize(item.answer)) > 1
    )


def items() -> list[dict]:
    """The task's rows: ``prompt``, ``answer`` (without its leading space), ``kind``, ``max_tokens``; each kind's
    items are sized with the tokenizer that makes its filler longest and redrawn until they keep the bounds under
    every tokenizer."""
    rng = random.Random(SEED)
    toks = tokenizers()
    units = [unit_tokens(t) for t in toks]
    sizers = {kind: max(zip(toks, units), key=lambda tu: tu[1][kind]) for kind in KINDS}  # its longest filler
    return [
        row(kind, rng, toks, sizer=sizers[kind], tokens=tokens)
        for _ in range(PER_LENGTH)
        for tokens in LENGTHS
        for kind in KINDS
    ]


def row(kind: str, rng: random.Random, toks: list, *, sizer: tuple, tokens: int) -> dict:
    """One task row of ``kind`` within ``tokens`` under every tokenizer: sized with ``sizer`` (a tokenizer and its
    :func:`unit_tokens`), the evidence's distances from both ends widened until every tokenizer keeps them."""
    tokenize, per_unit = sizer
    for margin in range(0, TAIL, 8):
        item = task_item(
            kind, rng, tokenize, tokens=tokens, lead=LEAD + margin // 2, tail=TAIL + margin, per_unit=per_unit
        )
        if all(fits(item, t, tokens=tokens) for t in toks):
            return {"prompt": item.prompt, "answer": item.answer[1:], "kind": kind, "max_tokens": tokens}
    raise ValueError(f"no {kind} item of {tokens} tokens keeps the task's bounds under every tokenizer")


def task_file_text(rows: list[dict]) -> str:
    """The task's jsonl: one item per line."""
    return "".join(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    task_rows = items()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(task_file_text(task_rows), encoding="utf-8")
    print(f"wrote {len(task_rows)} items to {OUT.relative_to(ROOT)}")
