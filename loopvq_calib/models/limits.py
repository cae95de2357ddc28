"""The sizes a model's config.json may ask for, checked on the raw JSON before transformers reads it or a model is
built: every size that drives memory or a loop over sites (layers, loop steps, heads, widths, window, vocabulary)
is an integer within a cap, and the RoPE base a finite number > 0 (docs/reliability.md, "Bounds"). A 10**9-layer
config.json is refused at once, not built on the meta device for minutes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..config.source import shown
from ..config.validate import MAX_LOOP_STEPS
from .files import ModelLoadError

MAX_LAYERS = 1024
MAX_SITES = 16_384  # KV sites: layers times loop steps (Ouro-1.4B has 96, Huginn-3.5B 132 at 32 recurrences)
MAX_HEADS = 1024
MAX_WIDTH = 65_536  # hidden size and head dim
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_WINDOW = 1 << 24
# model type -> config.json field -> (least value, cap); absent fields take the config class's defaults
SIZES = {
    "ouro": {"num_hidden_layers": (1, MAX_LAYERS), "total_ut_steps": (1, MAX_LOOP_STEPS),
             "num_attention_heads": (1, MAX_HEADS), "num_key_value_heads": (1, MAX_HEADS),
             "hidden_size": (1, MAX_WIDTH), "head_dim": (1, MAX_WIDTH), "intermediate_size": (1, MAX_INTERMEDIATE),
             "vocab_size": (1, MAX_VOCAB), "max_position_embeddings": (1, MAX_WINDOW)},
    "huginn_raven": {"n_layers": (1, MAX_LAYERS), "n_layers_in_prelude": (0, MAX_LAYERS),
                     "n_layers_in_recurrent_block": (1, MAX_LAYERS), "n_layers_in_coda": (0, MAX_LAYERS),
                     "mean_recurrence": (1, MAX_LOOP_STEPS), "n_heads": (1, MAX_HEADS), "n_embd": (1, MAX_WIDTH),
                     "intermediate_size": (1, MAX_INTERMEDIATE), "vocab_size": (1, MAX_VOCAB),
                     "padded_vocab_size": (1, MAX_VOCAB), "block_size": (1, MAX_WINDOW)},
}
ROPE_BASE = {"ouro": "rope_theta", "huginn_raven": "rope_base"}
ROLES = {"max_position_embeddings": "the model's window", "block_size": "the model's window",
         "total_ut_steps": "loop steps", "mean_recurrence": "loop steps"}  # named in messages
LOOPS = {"ouro": ("num_hidden_layers", "total_ut_steps"), "huginn_raven": ("n_layers_in_recurrent_block",
                                                                           "mean_recurrence")}


def check_config_sizes(raw: dict[str, Any], path: Path, key: str = "model.name_or_path") -> None:
    """``raw`` (config.json of a supported ``model_type``) asks for sizes within the caps (module docstring); the
    first that does not is a ModelLoadError naming the field, its value and ``path``."""
    model_type = raw["model_type"]
    where = f"{key}: {path}" if key else str(path)
    for field, (least, cap) in SIZES[model_type].items():
        value = raw.get(field)
        if value is None:
            continue
        name = f"{field} ({ROLES[field]})" if field in ROLES else field
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ModelLoadError(f"{where}: field {name} must be a {'positive' if least else 'non-negative'} integer, "
                                 f"got {shown(value)}")
        if value > cap:
            raise ModelLoadError(f"{where}: field {name} is {value:,}, more than this toolkit takes ({cap:,}: "
                                 "docs/reliability.md, \"Bounds\")")
    base = raw.get(ROPE_BASE[model_type])
    if base is not None and (not isinstance(base, (int, float)) or isinstance(base, bool) or not math.isfinite(base)
                             or base <= 0):
        raise ModelLoadError(f"{where}: field {ROPE_BASE[model_type]} (the RoPE base) must be a finite number > 0, "
                             f"got {shown(base)}")
    layers, steps = (raw.get(f) for f in LOOPS[model_type])
    if isinstance(layers, int) and isinstance(steps, int) and layers * steps > MAX_SITES:
        raise ModelLoadError(f"{where}: fields {LOOPS[model_type][0]} {layers:,} times {LOOPS[model_type][1]} "
                             f"{steps:,} give {layers * steps:,} KV sites; this toolkit takes at most {MAX_SITES:,}")


def looped_layers(model_config: Any) -> int:
    """The layers a loop step runs (Ouro: all of them; Huginn: its recurrent block), from a transformers config."""
    return int(getattr(model_config, LOOPS[model_config.model_type][0]))


def check_loop_sites(layers: int, steps: int, *, key: str) -> None:
    """``steps`` loop steps over ``layers`` looped layers stay within MAX_SITES (a loop count set by ``key``,
    e.g. model.loop_steps, over a model's config.json)."""
    if layers * steps > MAX_SITES:
        raise ModelLoadError(f"{key}: {steps:,} loop steps over {layers:,} looped layers give {layers * steps:,} KV "
                             f"sites; this toolkit takes at most {MAX_SITES:,}")
