"""loopvq-calib: sub-1-bit loop-axis VQ codebooks for the KV cache of looped transformers.

The public API: :func:`calibrate` runs the pipeline (as ``loopvq-calibrate`` does) and returns a
:class:`RunResult`; :func:`load_bundle` reads and validates a published :class:`Bundle`; :func:`evaluate`
measures bundles against full precision (as ``loopvq-eval`` does; settings :class:`ServedOptions` and
:class:`Gates`) and returns an :class:`EvalReport`; :class:`QuantizedLoopKVCache` serves a bundle's
:class:`KVQuantizer` through ``generate()``. Importing
``loopvq_calib.models`` registers the native Ouro and Huginn models with transformers' Auto classes.

Names are imported on first use, so ``import loopvq_calib`` (and a console script's ``--help``) loads neither
torch nor transformers; type checkers see them through the ``TYPE_CHECKING`` imports below.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .version import __version__

# public name -> the module that defines it (None: the name is that module)
_LAZY: dict[str, str | None] = {
    "Config": "config.schema",
    "ConfigError": "config.source",
    "load_config": "config.load",
    "calibrate": "calibration.pipeline",
    "RunResult": "calibration.pipeline",
    "Bundle": "bundle.reader",
    "BundleError": "bundle.reader",
    "load_bundle": "bundle.reader",
    "KVQuantizer": "codes.quantizer",
    "QuantizedLoopKVCache": "serving.cache",
    "EvalInputError": "evaluation.inputs",
    "EvalReport": "evaluation.evaluate",
    "Gates": "evaluation.options",
    "ServedOptions": "evaluation.options",
    "evaluate": "evaluation.evaluate",
    "models": None,
}

__all__ = [
    "Bundle",
    "BundleError",
    "Config",
    "ConfigError",
    "EvalInputError",
    "EvalReport",
    "Gates",
    "KVQuantizer",
    "QuantizedLoopKVCache",
    "RunResult",
    "ServedOptions",
    "__version__",
    "calibrate",
    "evaluate",
    "load_bundle",
    "load_config",
    "models",
]

if TYPE_CHECKING:
    from . import models
    from .bundle.reader import Bundle, BundleError, load_bundle
    from .calibration.pipeline import RunResult, calibrate
    from .codes.quantizer import KVQuantizer
    from .config.load import load_config
    from .config.schema import Config
    from .config.source import ConfigError
    from .evaluation.evaluate import EvalReport, evaluate
    from .evaluation.inputs import EvalInputError
    from .evaluation.options import Gates, ServedOptions
    from .serving.cache import QuantizedLoopKVCache


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'loopvq_calib' has no attribute {name!r}")
    module_name = _LAZY[name]
    if module_name is None:
        return import_module(f".{name}", __name__)
    return getattr(import_module(f".{module_name}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
