"""The pieces of the generated results pages: a markdown table, a paragraph wrapped at 115 columns, a fine-tuning
config in words."""

from __future__ import annotations

import textwrap
from typing import Any


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def wrap(text: str, indent: str = "") -> str:
    """A paragraph or a bullet (``indent``: its continuation lines' indent) wrapped at 115 columns."""
    return textwrap.fill(text, 115, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def recipe(f: dict[str, Any]) -> str:
    """A fine-tuning config in words (keys a config of its commit lacked read as that commit's behaviour)."""
    every = f"every {f['select_every']} steps" if f.get("select_every") else "after each epoch"
    warmup = f", {f['warmup_steps']} warm-up steps" if f.get("warmup_steps") else ""
    proximal = f", proximal {f['proximal']:g}" if f.get("proximal") else ""
    return (
        f"{f['epochs']} epochs, Adam lr {f['lr']:g}, {f.get('lr_schedule', 'constant')} schedule{warmup}, "
        f"selection {every}{proximal}"
    )
