"""scripts/make_local_task.py rebuilds the shipped lm-eval task file byte for byte, and its items are what the
task promises under every shipped reference model's tokenizer: at most their length, the answer several tokens
long, its evidence past the sink tokens and outside the recent window."""

from __future__ import annotations

import collections
import json

import yaml
from conftest import load_script

from loopvq_calib.evaluation.harness import TASKS_DIR

task = load_script("make_local_task")


def rows_on_disk() -> list[dict]:
    return [json.loads(line) for line in task.OUT.read_text(encoding="utf-8").splitlines()]


def test_rebuilds_the_shipped_task_file():
    assert task.task_file_text(task.items()) == task.OUT.read_text(encoding="utf-8")


def test_items_keep_the_bounds_under_every_tokenizer():
    rows = rows_on_disk()
    counts = collections.Counter((r["kind"], r["max_tokens"]) for r in rows)
    assert len(rows) >= 200 and set(counts.values()) == {task.PER_LENGTH}
    assert {k for k, _ in counts} == {"passkey", "registry", "copy"} and {n for _, n in counts} == set(task.LENGTHS)
    rounds = len(task.LENGTHS) * 3
    for start in range(0, len(rows), rounds):  # every round holds one item of each kind and length
        assert len({(r["kind"], r["max_tokens"]) for r in rows[start : start + rounds]}) == rounds
    for tokenize in task.tokenizers():
        for r in rows:
            prompt, answer = r["prompt"], r["answer"]
            size = len(tokenize(prompt))
            first, last = prompt.index(answer), prompt.rindex(answer) + len(answer)
            assert size <= r["max_tokens"] and len(tokenize(" " + answer)) > 1
            assert len(tokenize(prompt[:first])) >= task.LEAD  # the evidence is past the sinks
            assert size - len(tokenize(prompt[:last])) >= task.TAIL  # and outside the recent window


def test_the_task_yaml_scores_the_whole_answer():
    spec = yaml.load((TASKS_DIR / "loopvq_recall" / "loopvq_recall.yaml").read_text(), Loader=yaml.BaseLoader)
    assert spec["task"] == "loopvq_recall" and spec["output_type"] == "generate_until"
    assert spec["dataset_kwargs"]["data_files"]["test"] == task.OUT.name
    assert spec["generation_kwargs"]["until"] == ["\n"] and spec["generation_kwargs"]["do_sample"] == "false"
    assert [f["function"] for f in spec["filter_list"][0]["filter"]] == ["remove_whitespace", "take_first"]
    assert spec["metric_list"][0]["metric"] == "exact_match"
