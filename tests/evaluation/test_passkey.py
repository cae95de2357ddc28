"""Passkey retrieval: prompts of the asked lengths with the needle inside, scoring, accuracy per length."""

from __future__ import annotations

import pytest
import torch
from conftest import REFERENCE_MODEL, needs_lm_eval

from loopvq_calib.evaluation.passkey import FILLER, NEW_TOKENS, QUESTION, answered, make_trials, needle, run_passkey
from loopvq_calib.evaluation.served import Entry
from loopvq_calib.models.loading import load_model


@pytest.fixture(scope="module")
def reference():
    return load_model(REFERENCE_MODEL, "float32", torch.device("cpu"))


def test_trials_fit_their_length_and_hold_the_needle(reference):
    _, tok = reference
    trials = make_trials(tok, [64, 300], 4, seed=1)
    assert [t.length for t in trials] == [64] * 4 + [300] * 4
    unit = len(tok(FILLER, add_special_tokens=False)["input_ids"])
    for t in trials:
        n = len(tok(t.prompt, add_special_tokens=False)["input_ids"])
        assert t.length - unit - 2 <= n <= t.length  # the most filler repeats that fit
        assert needle(t.key) in t.prompt and t.prompt.endswith(QUESTION) and len(t.key) == 5
    assert make_trials(tok, [64], 4, seed=1)[0].key == trials[0].key  # seeded


def test_answered_takes_the_first_number():
    assert answered(" 48213. Remember", "48213")
    assert not answered(" 4821 3", "48213") and not answered(" none", "48213")


@needs_lm_eval
def test_accuracy_per_length_equals_greedy_generate(reference):
    model, tok = reference
    result = run_passkey(model, tok, [Entry("fp", "full-precision")], lengths=[48, 96], trials=2, seed=3)
    expected = {}
    for t in make_trials(tok, [48, 96], 2, seed=3):
        ids = torch.tensor([tok(t.prompt, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected.setdefault(str(t.length), []).append(answered(tok.decode(out[0, ids.shape[1] :]), t.key))
    assert result["accuracy"]["fp"] == {n: sum(v) / 2 for n, v in expected.items()}
    assert result["lengths"] == [48, 96] and result["trials_per_length"] == 2


def test_lengths_beyond_the_window_are_refused(reference):
    model, tok = reference
    with pytest.raises(ValueError, match=r"--passkey-lengths \[2045\]: .* window of 2048 tokens"):
        run_passkey(model, tok, [Entry("fp", "full-precision")], lengths=[64, 2045], trials=1)
