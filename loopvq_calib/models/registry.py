"""The looped architectures the toolkit takes, one :class:`Architecture` per ``model_type``.

Each architecture's own module (``models/ouro.py``, ``models/huginn.py``) declares it once and registers it with
:func:`register_architecture`; the loader, the size checks and the model's hooks
(:class:`~loopvq_calib.models.base.LoopedPreTrainedModel`) ask the registry instead of comparing ``model_type``
(recipe: docs/architecture.md, "Adding a looped architecture")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from ..config.source import shown
from .files import ModelLoadError


@dataclass(frozen=True)
class Architecture:
    """One looped architecture: its transformers classes and the config.json fields callers ask about."""

    config_class: type[PretrainedConfig]  # its ``model_type`` is the architecture's key
    model_class: type[PreTrainedModel]  # a LoopedPreTrainedModel (models/base.py), whose hooks read these fields
    loop_field: str  # the loop count (Ouro ``total_ut_steps``, Huginn recurrences ``mean_recurrence``)
    looped_layers_field: str  # the layers one loop step runs
    window_field: str  # the longest sequence the model takes (its RoPE and position range)
    rope_base_field: str
    size_caps: Mapping[str, tuple[int, int]]  # config.json field -> (least value, cap): models/limits.py

    @property
    def model_type(self) -> str:
        """The ``model_type`` of config.json that selects this architecture."""
        return self.config_class.model_type

    def window(self, config: Any) -> tuple[int, str]:
        """The model's window and the config field it comes from; anything but a positive integer there is a
        ModelLoadError naming the field and the file."""
        window = getattr(config, self.window_field, None)
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            where = Path(getattr(config, "name_or_path", "") or ".") / "config.json"
            raise ModelLoadError(
                f"{where}: field {self.window_field} (the model's window) must be a positive "
                f"integer, got {shown(window)}"
            )
        return window, self.window_field

    def looped_layers(self, config: Any) -> int:
        """The layers a loop step runs, from a transformers config."""
        return int(getattr(config, self.looped_layers_field))


_REGISTERED: dict[str, Architecture] = {}  # model_type -> architecture, in registration order


def register_architecture(arch: Architecture) -> Architecture:
    """Add ``arch`` under its ``model_type`` (one architecture per type) and register its classes with
    transformers' Auto classes; returns ``arch``."""
    if arch.model_class.config_class is not arch.config_class:
        raise ValueError(f"{arch.model_class.__name__}.config_class is not {arch.config_class.__name__}")
    known = _REGISTERED.get(arch.model_type)
    if known is not None and known != arch:
        raise ValueError(f"model_type {arch.model_type!r} is already registered ({known.model_class.__name__})")
    _REGISTERED[arch.model_type] = arch
    AutoConfig.register(arch.model_type, arch.config_class, exist_ok=True)
    AutoModelForCausalLM.register(arch.config_class, arch.model_class, exist_ok=True)
    return arch


def unregister_architecture(model_type: str) -> None:
    """Forget the architecture of ``model_type`` (transformers' Auto classes have no way back and keep theirs)."""
    _REGISTERED.pop(model_type, None)


def model_types() -> tuple[str, ...]:
    """The registered ``model_type`` values, in registration order."""
    return tuple(_REGISTERED)


def find_architecture(model_type: object) -> Architecture | None:
    """The architecture registered for ``model_type`` (any JSON value), or None."""
    return _REGISTERED.get(model_type) if isinstance(model_type, str) else None


def architecture_of(config: Any) -> Architecture:
    """The architecture of a transformers config (or a raw config.json dict); an unregistered type is a
    ValueError."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    arch = find_architecture(model_type)
    if arch is None:
        raise ValueError(
            f"model_type {shown(model_type)} is not a registered looped architecture; registered: "
            f"{', '.join(model_types())}"
        )
    return arch
