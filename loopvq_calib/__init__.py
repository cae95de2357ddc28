"""loopvq-calib: sub-1-bit loop-axis VQ codebooks for the KV cache of looped transformers."""

__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registers the native models with transformers)
