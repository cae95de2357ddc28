"""What a measurement records about where it ran: the checkout's commit and the device's name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from benchmarks.common.paths import ROOT


def short_commit(cwd: Path = ROOT) -> str | None:
    """The short commit of the checkout at ``cwd`` (None where git knows none, e.g. a copy without .git)."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True, text=True, cwd=cwd)
    return done.stdout.strip() or None


def git_commit() -> str | None:
    """The checkout's whole commit (``STUDY_COMMIT`` for a copy without its own .git; None without git)."""
    if os.environ.get("STUDY_COMMIT"):
        return os.environ["STUDY_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git there
        return None
    return done.stdout.strip() or None


def device_name(device: str) -> str:
    """The GPU's name for a CUDA run, else ``cpu``."""
    import torch

    return torch.cuda.get_device_name() if device != "cpu" and torch.cuda.is_available() else "cpu"
