"""loopvq-calib: sub-1-bit loop-axis VQ codebooks for the KV cache of looped transformers.

``calibrate(config)`` runs the pipeline (as ``loopvq-calibrate`` does); ``load_bundle(path)`` reads and
validates a published bundle; importing ``loopvq_calib.models`` registers the native Ouro and Huginn
models with transformers' Auto classes. Everything is imported on first use, so ``import loopvq_calib``
(and a console script's ``--help``) does not load torch or transformers.
"""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "calibrate", "load_bundle", "models"]

_LAZY = {"calibrate": (".pipeline", "calibrate"), "load_bundle": (".bundle", "load_bundle"), "models": (".models", None)}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loopvq_calib' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = import_module(module_name, __name__)
    return module if attr is None else getattr(module, attr)
