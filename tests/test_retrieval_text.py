"""scripts/retrieval_text.py: recall documents hold their evidence where they say, sized items keep their bounds
under a real tokenizer, training rows are packed from whole documents, and exact-answer rates score the answer
tokens only."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import REFERENCE_MODEL, load_script
from transformers import AutoTokenizer

rt = load_script("retrieval_text")


@pytest.fixture(scope="module")
def tokenize():
    tok = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", rt.KINDS)
def test_the_answer_stands_in_the_evidence_and_nowhere_after_it(kind, tokenize):
    rng = random.Random(kind)
    for _ in range(30):
        item = rt.make_item(kind, rng, before=rng.randint(0, 12), after=rng.randint(0, 12))
        answer = item.answer.strip()
        assert item.answer == " " + answer and answer in item.prompt[item.evidence_start : item.evidence_end]
        assert answer not in item.prompt[item.evidence_end :] and "\n" not in answer
        head = tokenize(item.prompt)
        assert tokenize(item.prompt + item.answer)[: len(head)] == head  # the prompt's tokens are a prefix


@pytest.mark.parametrize("kind", rt.KINDS)
def test_task_items_keep_their_bounds_under_the_tokenizer(kind, tokenize):
    rng = random.Random(1)
    for tokens in (256, 700):
        item = rt.task_item(kind, rng, tokenize, tokens=tokens, lead=16, tail=128)
        assert len(tokenize(item.prompt)) <= tokens
        assert len(tokenize(item.prompt[: item.evidence_start])) >= 16
        assert len(tokenize(item.prompt)) - len(tokenize(item.prompt[: item.evidence_end])) >= 128
    with pytest.raises(ValueError, match=f"no {kind} item of at most 64 tokens"):
        rt.task_item(kind, rng, tokenize, tokens=64, tail=128)


def test_recall_rows_are_packed_from_whole_documents_of_every_kind(tokenize):
    rows = list(itertools.islice(rt.recall_rows(tokenize, random.Random(0), seq=300, eos=0), 4))
    assert all(r.shape == (300,) and r.dtype.name == "int64" for r in rows)
    # the same draws, by hand: documents of each kind in turn, each followed by eos, cut at the row's end
    rng, per_unit, turn = random.Random(0), rt.unit_tokens(tokenize), 0
    for row in rows:
        expected: list[int] = []
        while len(expected) < 300:
            item = rt.training_item(rt.KINDS[turn % 3], rng, max_tokens=300, per_unit=per_unit)
            turn += 1
            expected += tokenize(item.prompt + item.answer + "\n") + [0]
        assert row.tolist() == expected[:300]
    assert turn >= 4  # every row starts a new document


class Oracle(torch.nn.Module):
    """Logits that put all mass on the true next token (``shift=1``) or on the current one (``shift=0``)."""

    def __init__(self, shift: int) -> None:
        super().__init__()
        self.shift, self.device = shift, torch.device("cpu")

    def forward(self, ids: torch.Tensor):
        target = torch.cat([ids[:, self.shift :], ids[:, -1:].expand(-1, self.shift)], 1)
        return type("Out", (), {"logits": torch.nn.functional.one_hot(target, 5000).float()})()


def test_recall_accuracy_scores_every_answer_token(tokenize):
    perfect = rt.recall_accuracy(Oracle(1), tokenize, kind="registry", tokens=300, items=3)
    copying = rt.recall_accuracy(Oracle(0), tokenize, kind="registry", tokens=300, items=3)
    assert perfect["exact"] == 1.0 and copying["exact"] == 0.0
    assert perfect["items"] == 3 and perfect["mean_tokens"] <= 300
