"""The console scripts of pyproject.toml: each runs its command's module, prints its own usage for --help before
torch, transformers, datasets or numpy are imported, and has its parser in PARSERS."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

from loopvq_calib.cli import PARSERS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("torch", "transformers", "datasets", "safetensors", "numpy")
HELP_PROBE = f"""
import importlib, sys
module, function = sys.argv[1].split(":")
sys.argv = [sys.argv[2], "--help"]
try:
    getattr(importlib.import_module(module), function)()
except SystemExit as exit:
    assert exit.code == 0, exit.code
print("heavy:", *(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_every_console_script_has_its_parser():
    assert sorted(SCRIPTS) == sorted(PARSERS) == ["loopvq-calibrate", "loopvq-eval", "loopvq-inspect", "loopvq-push"]
    assert all(PARSERS[name]().prog == name for name in PARSERS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_imports_nothing_heavy(script):
    """The console script's entry point parses --help and prints its usage before torch, transformers, datasets
    or numpy are imported (it then takes well under a second; with torch loaded it took 4-5 s)."""
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, SCRIPTS[script], script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"usage: {script} ")
    assert lines[-1] == "heavy:"
