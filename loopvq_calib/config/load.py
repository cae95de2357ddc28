"""Building the config tree from YAML and ``--set`` overrides: types coerced, derived values filled, paths
resolved, then validated once (:func:`load_config`). Errors raise :class:`~loopvq_calib.config.source.ConfigError`
naming the key path; the CLI turns them into exit status 2 before any work starts."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .schema import Config
from .source import PATH_KEYS, SHOWN_CHARS, ConfigError, apply_overrides, copy_sections, read_yaml, resolve_paths, shown
from .validate import derived_bits, exact_fisher_channels, validate


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((k for k in raw if k not in names), key=str)  # YAML keys may be numbers too
    if unknown:
        name = unknown[0] if isinstance(unknown[0], str) and len(unknown[0]) <= SHOWN_CHARS else shown(unknown[0])
        raise ConfigError(f"{path}.{name}" if path else name, f"unknown key; allowed here: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        tp = next((a for a in kinds if type(value) is a), kinds[0])  # bool | str: True stays True, "auto" a str
    if value is None:
        raise ConfigError(path, f"must not be null (expected {tp.__name__})")
    if tp is str and isinstance(value, bool):
        return "true" if value else "false"  # YAML reads true/false unquoted as booleans (cache_teacher: true)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError as err:
            raise ConfigError(path, f"{shown(value)} is out of range for a float") from err
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-5 as a string
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(path, f"expected {tp.__name__}, got {type(value).__name__} {shown(value)}")
    return value


def load_config(source: str | Path | dict, overrides: list[str] | None = None) -> Config:
    """Load YAML (a path or an already-parsed mapping), apply ``key.path=value`` overrides, resolve the
    derived values and the paths, validate (the one validation pass; nothing is touched on disk).

    Relative local paths written in a config file resolve against the file's folder; those from ``--set``,
    from a mapping and the defaults against the current directory (docs/config.md, "Paths")."""
    if isinstance(source, dict):
        raw, base = source, Path.cwd()
    else:
        path = Path(source)
        raw, base = read_yaml(path), path.absolute().parent
    if not isinstance(raw, dict):
        raise ConfigError("", f"the top level of the config must be a mapping of sections, got {type(raw).__name__}")
    raw = resolve_paths(copy_sections(raw), base)
    overridden = {k for k in PATH_KEYS if any(o.split("=", 1)[0].strip() == k for o in overrides or [])}
    raw = apply_overrides(raw, overrides or [])
    raw = resolve_paths(raw, Path.cwd(), tuple(sorted(overridden | _fill_path_defaults(raw))))
    return validate(resolve_derived(_build(Config, raw, "")))


def resolve_derived(cfg: Config) -> Config:
    """Fill the values a config may leave null: ``quant.bits`` (from K and G),
    ``output.serving.sink_tokens`` (= ``data.sink_tokens``) and ``capture.fisher_channels`` (the largest exact
    value, :func:`exact_fisher_channels`). The only place the loader changes values."""
    if cfg.quant.bits is None and math.isfinite(derived_bits(cfg.quant)):
        cfg.quant.bits = derived_bits(cfg.quant)
    if cfg.capture.fisher_channels is None and cfg.quant.group_size > 0 and cfg.quant.block_steps > 0:
        cfg.capture.fisher_channels = exact_fisher_channels(cfg.quant)
    if cfg.output.serving.sink_tokens is None:
        cfg.output.serving.sink_tokens = cfg.data.sink_tokens
    return cfg


def _fill_path_defaults(raw: dict) -> set[str]:
    """Put the default of every path key the config leaves out into ``raw``; returns those keys."""
    filled = set()
    for key in PATH_KEYS:
        section, name = key.split(".")
        node = raw.setdefault(section, {})
        if isinstance(node, dict) and name not in node:
            node[name] = getattr(getattr(Config(), section), name)
            filled.add(key)
    return filled


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (written to every run directory)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
