"""Load a task's local json/jsonl files, paths relative to this folder (any working directory, offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load_json(data_files: dict[str, str], **_: Any) -> Any:
    """``datasets.load_dataset("json", data_files=...)`` with each relative path resolved against this folder."""
    import datasets

    files = {split: str(HERE / path) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
