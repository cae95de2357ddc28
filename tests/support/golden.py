"""Where the golden vectors live and how an attention-level golden case is read."""

from __future__ import annotations

from conftest import ROOT, load_script

from loopvq_calib.bundle.reader import load_bundle

GOLDEN = ROOT / "tests" / "golden"


GOLDEN_ATTENTION = ROOT / "tests" / "golden_attention"


def attention_golden_case(case: str):
    """scripts/make_attention_golden.py as a module, the block of golden bundle ``case`` it uses, the bundle and
    the block's key and value codecs."""
    module = load_script("make_attention_golden")
    block = module.BLOCKS[case]
    bundle = load_bundle(GOLDEN / case)
    codecs = [bundle.quantizer.codecs[f"{kind}.{block}"] for kind in ("key", "value")]
    return module, block, bundle, codecs
