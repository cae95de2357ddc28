"""The Python standard library's source files as training text, for both reference scripts: the Huginn reference's
whole corpus, and optional extra training text of the Ouro reference (``train_reference_model.py prepare
--python-text``). Source code repeats names and lines within a file, which is what teaches a small model to read
its context back."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

HELDOUT_FRACTION = 0.02  # the share of files held out (a seeded sample)


def stdlib_files(max_files: int | None = None) -> tuple[Path, list[Path]]:
    """The interpreter's standard-library folder and its ``*.py`` files (site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
    return root, files[:max_files] if max_files else files


def read_sources(root: Path, files: list[Path]) -> list[tuple[str, str]]:
    """(relative name, text) of every file that is UTF-8 text."""
    out = []
    for path in files:
        try:
            out.append((path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def split_sources(
    sources: list[tuple[str, str]], rng: random.Random, *, heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[list[str], list[tuple[str, str]]]:
    """The training texts (in file order) and the held-out (name, text) pairs: ``heldout_fraction`` of the files,
    at least one, drawn from ``rng``; the same seed and files give the same split in both scripts."""
    held_names = set(rng.sample([n for n, _ in sources], max(1, round(len(sources) * heldout_fraction))))
    return [t for n, t in sources if n not in held_names], [(n, t) for n, t in sources if n in held_names]
