"""Where a config's raw values come from: the YAML file (UTF-8 checked), ``--set`` overrides, and which
values are local paths (resolved to absolute ones; docs/config.md, "Paths").

A value is local when it exists, looks like a path (absolute, ``./``, ``~``, glob, a data suffix, not exactly
one ``/``) or starts with an existing folder; otherwise it is a hub id ``org/name``. Local values become
absolute paths, so what a run records works from any working directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

PATH_KEYS = ("model.name_or_path", "data.dataset", "output.dir")
# file suffix -> datasets builder
LOCAL_TYPES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
LOCAL_DATA_SUFFIXES = tuple(LOCAL_TYPES)


class ConfigError(ValueError):
    """A config value is unknown, mistyped or impossible; ``path`` is its dotted key path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


def read_yaml(path: Path) -> Any:
    """The parsed YAML of a config file; a missing, unreadable, non-UTF-8 or invalid file names the path."""
    if not path.is_file():
        raise ConfigError("", f"config file {path} {'does not exist' if not path.exists() else 'is not a file'}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start:err.start + 1]
        raise ConfigError("", f"config file {path} is not UTF-8 text (byte {err.start}: {bad!r})") from err
    except OSError as err:
        raise ConfigError("", f"config file {path} cannot be read: {err.strerror}") from err
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError("", f"{path} is not valid YAML: {err}") from err


def copy_sections(raw: dict) -> dict:
    """A copy of the top level and of each section (the loader edits these, never the caller's mapping)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``--set key.path=value`` items (values in YAML syntax) to a copy of the parsed config."""
    raw = copy_sections(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError("", f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise ConfigError("", f"--set {item!r}: {key.strip()!r} is not a key path like quant.bits")
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError as err:
            problem = str(err).splitlines()[0]
            raise ConfigError(key.strip(), f"--set value {value!r} is not valid YAML ({problem}); quote strings, "
                                           "e.g. --set 'data.dataset=\"my file.txt\"'") from err
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = parsed
    return raw


def looks_local(spec: str, base: Path, suffixes: tuple[str, ...] = ()) -> bool:
    """Whether ``spec`` names a local path rather than a hub id ``org/name``: it exists under ``base``, is
    absolute or starts with ``.``/``~``, has no ``/`` or more than one, ends in one of ``suffixes``, holds
    glob characters, or its first component is a folder under ``base`` (``artifacts/nope``)."""
    if spec.startswith(("/", ".", "~")) or "\\" in spec or any(ch in spec for ch in "*?["):
        return True
    if spec.count("/") != 1 or spec.endswith(suffixes) or (base / spec).exists():
        return True
    return (base / spec.split("/")[0]).is_dir()


def resolve_paths(raw: dict, base: Path, keys: tuple[str, ...] = PATH_KEYS) -> dict:
    """Make the local paths among ``keys`` (of PATH_KEYS) absolute against ``base``; hub ids stay as they are."""
    for key in keys:
        section, name = key.split(".")
        node = raw.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value.strip():
            continue
        if key == "output.dir" or (key == "model.name_or_path" and looks_local(value, base)) or (
                key == "data.dataset" and node.get("type") != "hub" and _local_dataset(value, base)):
            node[name] = _absolute(value, base)
    return raw


def _local_dataset(spec: str, base: Path) -> bool:
    """A bare name (``wikitext``) that is no file here is a hub dataset; otherwise as :func:`looks_local`."""
    bare = "/" not in spec and not spec.startswith((".", "~")) and not any(ch in spec for ch in "*?[")
    if bare and not spec.endswith(LOCAL_DATA_SUFFIXES) and not (base / spec).exists():
        return False
    return looks_local(spec, base, LOCAL_DATA_SUFFIXES)


def _absolute(spec: str, base: Path) -> str:
    """``spec`` (``~`` expanded) against ``base``, normalised (``a/../b`` -> ``b``)."""
    return os.path.normpath(base / Path(spec).expanduser())
