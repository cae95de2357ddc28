"""``sampled_quantizer``: a crude quantizer without k-means (random group vectors of one forward), the one of
benchmarks/common/quantizers.py, loaded from that file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SOURCE = Path(__file__).resolve().parents[2] / "benchmarks" / "common" / "quantizers.py"
_spec = importlib.util.spec_from_file_location("benchmarks_quantizers", _SOURCE)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
sampled_quantizer = _module.sampled_quantizer
