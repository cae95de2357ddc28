"""scripts/make_local_task.py rebuilds the shipped lm-eval task file byte for byte, and its items are what the
module docstring says: the context ends just before the phrase's last word, which is the answer."""

from __future__ import annotations

import json

from conftest import load_script

task = load_script("make_local_task")


def test_rebuilds_the_shipped_task_file():
    assert task.OUT.is_file()
    assert task_rows_on_disk() == task.items()
    assert task.task_file_text(task.items()) == task.OUT.read_text(encoding="utf-8")


def test_each_context_ends_before_its_phrase_last_word():
    sources = {json.loads(line)["source"]: json.loads(line)["text"]
               for line in task.SOURCE.read_text(encoding="utf-8").splitlines()}
    rows = task_rows_on_disk()
    assert {r["phrase"] for r in rows} <= set(task.PHRASES)
    for row in rows:
        head, last = row["phrase"].rsplit(" ", 1)
        assert row["answer"] == last
        assert row["context"].split()[-len(head.split()):] == head.split()
        assert len(row["context"]) <= task.CONTEXT_CHARS
        text = sources[row["source"]]
        assert row["context"] in text and text[text.index(row["context"]) + len(row["context"]):].lstrip().startswith(last)
    counts = [sum(r["phrase"] == p for r in rows) for p in task.PHRASES]
    assert max(counts) <= task.PER_PHRASE


def task_rows_on_disk() -> list[dict[str, str]]:
    return [json.loads(line) for line in task.OUT.read_text(encoding="utf-8").splitlines()]
