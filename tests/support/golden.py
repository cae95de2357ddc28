"""Where the golden vectors live, how an attention-level golden case is read, and a copy of the golden bundle
ouro_loopvq to edit (the ``bundle_dir`` fixture) with the bytes of its files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import ROOT, load_script

from loopvq_calib.bundle.reader import load_bundle

GOLDEN = ROOT / "tests" / "golden"

GOLDEN_BUNDLE = GOLDEN / "ouro_loopvq"


GOLDEN_ATTENTION = ROOT / "tests" / "golden_attention"


def attention_golden_case(case: str):
    """scripts/make_attention_golden.py as a module, the block of golden bundle ``case`` it uses, the bundle and
    the block's key and value codecs."""
    module = load_script("make_attention_golden")
    block = module.BLOCKS[case]
    bundle = load_bundle(GOLDEN / case)
    codecs = [bundle.quantizer.codecs[f"{kind}.{block}"] for kind in ("key", "value")]
    return module, block, bundle, codecs


@pytest.fixture
def bundle_dir(tmp_path: Path) -> Path:
    """A copy of the golden bundle ouro_loopvq, free to edit."""
    return Path(shutil.copytree(GOLDEN_BUNDLE, tmp_path / "bundle"))


def bundle_files(folder: Path) -> dict[str, bytes]:
    """The bytes of every entry directly in ``folder``, by name."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
