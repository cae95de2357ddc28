"""Build the shipped local lm-eval task ``loopvq_kjv_phrases`` from artifacts/data/kjv-calib.jsonl.

Each item is ~900 characters of *Proverbs* or *Acts* (books the reference model never saw) ending just
before the last word of a frequent King James phrase ("Holy Ghost", "came to pass", ...); the answer is
that word. Items are picked by rule (the first occurrences with enough context), not by the model's
answers. Command: ``python scripts/make_local_task.py`` (rewrites the task's jsonl).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "artifacts" / "data" / "kjv-calib.jsonl"
OUT = ROOT / "loopvq_calib" / "evaluation" / "tasks" / "loopvq_kjv_phrases" / "kjv_phrases.jsonl"
PHRASES = ("Holy Ghost", "came to pass", "children of Israel", "kingdom of God", "fear of the LORD", "Son of God",
           "Jesus Christ", "word of God", "right hand", "house of Israel")
CONTEXT_CHARS = 900
PER_PHRASE = 5


def items() -> list[dict[str, str]]:
    """The task's items: per phrase, its first ``PER_PHRASE`` occurrences with ``CONTEXT_CHARS`` of context that
    do not start a line with the answer."""
    docs = [json.loads(line) for line in SOURCE.read_text(encoding="utf-8").splitlines()]
    out = []
    for phrase in PHRASES:
        pattern = re.compile(r"\b" + r"\s+".join(map(re.escape, phrase.split())) + r"\b")
        found = []
        for doc in docs:
            text = doc["text"]
            for m in pattern.finditer(text):
                cut = m.start() + m.group(0).rindex(phrase.split()[-1])
                if m.start() < CONTEXT_CHARS or text[cut - 1] == "\n":
                    continue  # too little context, or the answer starts a line
                found.append({"context": text[cut - CONTEXT_CHARS:cut].rstrip(), "answer": phrase.split()[-1],
                              "phrase": phrase, "source": doc["source"]})
        out += found[:PER_PHRASE]
    return out


def task_file_text(rows: list[dict[str, str]]) -> str:
    """The task's jsonl: one item per line."""
    return "".join(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    rows = items()
    OUT.write_text(task_file_text(rows), encoding="utf-8")
    print(f"wrote {len(rows)} items to {OUT.relative_to(ROOT)}")
