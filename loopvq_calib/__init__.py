"""loopvq-calib: sub-1-bit loop-axis VQ codebooks for the KV cache of looped transformers.

``calibrate(config)`` runs the pipeline (as ``loopvq-calibrate`` does); ``load_bundle(path)`` reads and
validates a published bundle.
"""

from typing import Any

__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers the native models with transformers)

__all__ = ["__version__", "calibrate", "load_bundle", "models"]


def __getattr__(name: str) -> Any:
    if name == "calibrate":
        from .pipeline import calibrate

        return calibrate
    if name == "load_bundle":
        from .bundle import load_bundle

        return load_bundle
    raise AttributeError(f"module 'loopvq_calib' has no attribute {name!r}")
