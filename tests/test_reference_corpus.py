"""scripts/reference_corpus.py: the Ouro reference's corpus preparation with a given tokenizer."""

from __future__ import annotations

import json

import numpy as np
from conftest import REFERENCE_MODEL, load_script
from transformers import PreTrainedTokenizerFast

corpus = load_script("reference_corpus")


def test_prepare_with_a_given_tokenizer_keeps_it_and_tokenizes_with_it(tmp_path, monkeypatch):
    """``prepare --tokenizer`` (:func:`prepare_corpus` with a tokenizer folder): the folder's tokenizer is saved
    unchanged into the model folder and the token ids are that tokenizer's (checked by decoding them back to the
    held-out plays); extra training documents join the training ids."""
    plays = tmp_path / "plays"
    plays.mkdir()
    names = [*corpus.CALIB_PLAYS, *corpus.HELDOUT_PLAYS, "lear_gut.txt"]
    for i, name in enumerate(names):
        (plays / name).write_text(f"Enter the {i}th player. What say you, good friend?\n", encoding="utf-8")
    books = {b: f"In the beginning of {b} was the word." for b in (*corpus.KJV_CALIB_BOOKS, "Genesis")}
    monkeypatch.setattr(corpus, "shakespeare_dir", lambda: plays)
    monkeypatch.setattr(corpus, "kjv_books", lambda: books)
    monkeypatch.setattr(corpus, "DATA_DIR", tmp_path / "data")
    extra = ["def f(x):\n    return x\n"]
    corpus.prepare_corpus(
        tmp_path / "model",
        tmp_path / "ids",
        tokenizer=REFERENCE_MODEL,
        seed=0,
        vocab_size=4096,
        window=2048,
        extra_train=extra,
    )
    saved = json.loads((tmp_path / "model" / "tokenizer.json").read_text())
    assert saved == json.loads((REFERENCE_MODEL / "tokenizer.json").read_text())
    tok = PreTrainedTokenizerFast.from_pretrained(REFERENCE_MODEL)
    held = np.load(tmp_path / "ids" / "heldout_tokens.npy").tolist()
    assert (
        tok.decode(held)
        == "<|endoftext|>".join((plays / n).read_text() for n in corpus.HELDOUT_PLAYS) + "<|endoftext|>"
    )
    train = np.load(tmp_path / "ids" / "train_tokens.npy").tolist()
    assert tok.decode(train).count("<|endoftext|>") == 3  # lear, Genesis and the extra document, at the end
    assert tok.decode(train).endswith(extra[0] + "<|endoftext|>")
