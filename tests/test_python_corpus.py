"""scripts/python_corpus.py: reading source files and the seeded held-out split both reference scripts share."""

from __future__ import annotations

import random

from conftest import load_script

corpus = load_script("python_corpus")


def test_read_sources_keeps_utf8_files_by_relative_name_and_skips_the_others(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 'é'\n", encoding="utf-8")
    (tmp_path / "b.py").write_bytes(b"\xff\xfe not utf-8")
    files = [tmp_path / "pkg" / "a.py", tmp_path / "b.py"]
    assert corpus.read_sources(tmp_path, files) == [("pkg/a.py", "x = 'é'\n")]


def test_the_split_holds_out_the_fraction_drawn_from_the_seed_and_keeps_file_order():
    sources = [(f"f{i}.py", f"text {i}") for i in range(120)]
    train, held = corpus.split_sources(sources, random.Random(0), heldout_fraction=0.05)
    names = random.Random(0).sample([n for n, _ in sources], 6)  # round(120 x 0.05) files, the same draw
    assert sorted(n for n, _ in held) == sorted(names)
    assert train == [t for n, t in sources if n not in names]  # in file order
    assert corpus.split_sources(sources[:10], random.Random(1), heldout_fraction=0.01)[1] != []  # at least one
