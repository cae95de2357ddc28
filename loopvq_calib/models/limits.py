"""The sizes a model's config.json may ask for, checked on the raw JSON before transformers reads it or a model is
built: every size that drives memory or a loop over sites (layers, loop steps, heads, widths, window, vocabulary)
is an integer within a cap, and the RoPE base a finite number > 0 (docs/reliability.md, "Bounds"). A 10**9-layer
config.json is refused at once, not built on the meta device for minutes. The caps are here; which fields each
architecture caps, it declares (``Architecture.size_caps``, models/registry.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..config.source import shown
from .files import ModelLoadError
from .registry import architecture_of

MAX_LAYERS = 1024
MAX_SITES = 16_384  # KV sites: layers times loop steps (Ouro-1.4B has 96, Huginn-3.5B 132 at 32 recurrences)
MAX_HEADS = 1024
MAX_WIDTH = 65_536  # hidden size and head dim
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_WINDOW = 1 << 24


def check_config_sizes(raw: dict[str, Any], path: Path, key: str = "model.name_or_path") -> None:
    """``raw`` (config.json of a supported ``model_type``) asks for sizes within the caps (module docstring); the
    first that does not is a ModelLoadError naming the field, its value and ``path``."""
    arch = architecture_of(raw)
    roles = {arch.window_field: "the model's window", arch.loop_field: "loop steps"}  # named in messages
    where = f"{key}: {path}" if key else str(path)
    for field, (least, cap) in arch.size_caps.items():
        value = raw.get(field)
        if value is None:
            continue
        name = f"{field} ({roles[field]})" if field in roles else field
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelLoadError(
                f"{where}: field {name} must be a {'positive' if least else 'non-negative'} integer, got {shown(value)}"
            )
        if value > cap:
            raise ModelLoadError(
                f"{where}: field {name} is {value:,}, more than this toolkit takes ({cap:,}: "
                'docs/reliability.md, "Bounds")'
            )
    base = raw.get(arch.rope_base_field)
    if base is not None and (
        not isinstance(base, (int, float)) or isinstance(base, bool) or not math.isfinite(base) or base <= 0
    ):
        raise ModelLoadError(
            f"{where}: field {arch.rope_base_field} (the RoPE base) must be a finite number > 0, got {shown(base)}"
        )
    layers, steps = raw.get(arch.looped_layers_field), raw.get(arch.loop_field)
    if isinstance(layers, int) and isinstance(steps, int) and layers * steps > MAX_SITES:
        raise ModelLoadError(
            f"{where}: fields {arch.looped_layers_field} {layers:,} times {arch.loop_field} "
            f"{steps:,} give {layers * steps:,} KV sites; this toolkit takes at most {MAX_SITES:,}"
        )


def looped_layers(model_config: Any) -> int:
    """The layers a loop step runs (Ouro: all of them; Huginn: its recurrent block), from a transformers config."""
    return architecture_of(model_config).looped_layers(model_config)


def check_loop_sites(layers: int, steps: int, *, key: str) -> None:
    """``steps`` loop steps over ``layers`` looped layers stay within MAX_SITES (a loop count set by ``key``,
    e.g. model.loop_steps, over a model's config.json)."""
    if layers * steps > MAX_SITES:
        raise ModelLoadError(
            f"{key}: {steps:,} loop steps over {layers:,} looped layers give {layers * steps:,} KV "
            f"sites; this toolkit takes at most {MAX_SITES:,}"
        )
