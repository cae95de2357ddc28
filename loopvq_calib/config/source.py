"""Where a config's raw values come from: the YAML file (UTF-8 checked), ``--set`` overrides, and which
values are local paths (resolved to absolute ones; docs/config.md, "Paths").

Both are read by one strict YAML loader (:func:`parse_yaml`): anchors and aliases, merge keys (``<<``), duplicate
mapping keys and nesting deeper than :data:`MAX_DEPTH` are refused with a :class:`ConfigError` naming the key path
and the line.
Every message that shows a value shows it through :func:`shown`, cut to a few dozen characters.

A value is local when it exists, looks like a path (absolute, ``./``, ``~``, glob, a data suffix, not exactly
one ``/``) or starts with an existing folder; otherwise it is a hub id ``org/name``. Local values become
absolute paths, so what a run records works from any working directory.
"""

from __future__ import annotations

import os
import reprlib
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

PATH_KEYS = ("model.name_or_path", "data.dataset", "output.dir")
# file suffix -> datasets builder
LOCAL_TYPES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
LOCAL_DATA_SUFFIXES = tuple(LOCAL_TYPES)
MAX_DEPTH = 32  # nesting levels of a YAML document (the config tree needs 3, a list value one or two more)
SHOWN_CHARS = 80  # the longest value an error message shows
MERGE_TAG = "tag:yaml.org,2002:merge"  # what YAML resolves a plain ``<<`` key to


class ConfigError(ValueError):
    """A config value is unknown, mistyped or impossible; ``path`` is its dotted key path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, at most ``limit`` characters (``...`` marks a cut), built without
    formatting more of the value than that (a huge list or integer costs no more than a small one)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4 * limit:
        text = f"<an integer of {value.bit_length()} bits>"
    else:
        text = _REPR.repr(value)
    return cut(text, limit)


def cut(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters, ``...`` marking a cut."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(err: BaseException, limit: int = 200) -> str:
    """The first line of an error's message, at most ``limit`` characters (:func:`cut`)."""
    lines = str(err).strip().splitlines()
    return cut(lines[0], limit) if lines else ""


def _bounded_repr() -> reprlib.Repr:
    """reprlib settings that keep :func:`shown`'s work bounded (Python 3.11's Repr takes no arguments)."""
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = r.maxfrozenset = r.maxdeque = r.maxarray = 8
    return r


_REPR = _bounded_repr()


class StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that tracks the key path of the node it composes and refuses anchors and aliases
    (an alias can expand a few lines into billions of values), merge keys ``<<`` and duplicate mapping keys (one
    would silently win over the other) and nesting deeper than :data:`MAX_DEPTH`: each a :class:`ConfigError`
    naming the key path and the line of ``source`` (a config file, or ``--set KEY`` whose key path ``prefix``
    starts every path)."""

    def __init__(self, text: str, source: str, prefix: str = "") -> None:
        super().__init__(text)
        self.source, self.lines = source, "\n" in text.strip()
        self.keys: list[str] = [prefix] if prefix else []
        self.depth = 0

    def path(self) -> str:
        """The dotted key path of the node being composed (list items as ``[i]``)."""
        return "".join(k if k.startswith("[") or i == 0 else "." + k for i, k in enumerate(self.keys))

    def where(self, node_or_event: Any) -> str:
        """``<source> line N`` of a node or event (the source alone for a one-line text, a ``--set`` value)."""
        return f"{self.source} line {node_or_event.start_mark.line + 1}" if self.lines else self.source

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        """Compose one node under ``parent`` (``index``: the key node of a mapping value, a list position, or
        None for a key or the document), refusing what the class docstring says."""
        key = _key_of(parent, index)
        if key is not None:
            self.keys.append(key)
        self.depth += 1
        try:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                mark = "*" if isinstance(event, yaml.AliasEvent) else "&"
                raise ConfigError(
                    self.path(),
                    f"YAML anchors and aliases are not allowed ({mark}{event.anchor} at "
                    f"{self.where(event)}); write the value out",
                )
            if self.depth > MAX_DEPTH:
                path = self.path()
                raise ConfigError(
                    path if len(path) <= SHOWN_CHARS else path[: SHOWN_CHARS - 3] + "...",
                    f"nested deeper than {MAX_DEPTH} levels ({self.where(event)})",
                )
            node = super().compose_node(parent, index)
            if isinstance(node, MappingNode):
                self._check_unique(node)
            return node
        finally:
            self.depth -= 1
            if key is not None:
                self.keys.pop()

    def _check_unique(self, node: MappingNode) -> None:
        """Every key of a mapping appears once, and none is a merge key (whose keys could repeat others)."""
        first: dict[str, Node] = {}
        for key, _ in node.value:
            if key.tag == MERGE_TAG:
                raise ConfigError(
                    self.path(), f"YAML merge keys (<<) are not allowed (<< at {self.where(key)}); write the keys out"
                )
            name = key.value if isinstance(key, ScalarNode) else None
            if name is None:
                continue
            if name in first:
                self.keys.append(name if len(name) <= SHOWN_CHARS else shown(name))
                path = self.path()
                self.keys.pop()
                again = f" and line {key.start_mark.line + 1}" if self.lines else " twice"
                raise ConfigError(path, f"duplicate key ({self.where(first[name])}{again}); each key may appear once")
            first[name] = key


def _key_of(parent: Node | None, index: Any) -> str | None:
    """The key path part a child node adds: a mapping value its key, a list item ``[i]``, a key nothing."""
    if isinstance(parent, SequenceNode):
        return f"[{index}]"
    if isinstance(parent, MappingNode) and isinstance(index, Node):
        name = index.value if isinstance(index, ScalarNode) else "?"
        return name if len(name) <= SHOWN_CHARS else shown(name)
    return None


def parse_yaml(text: str, source: str, prefix: str = "") -> Any:
    """One YAML document through :class:`StrictLoader`; raises ConfigError for what it refuses (a too-deep
    document included, whatever the interpreter's recursion limit) and yaml.YAMLError for bad syntax."""
    loader = StrictLoader(text, source, prefix)
    try:
        return loader.get_single_data()
    except RecursionError as err:
        raise ConfigError(prefix, f"{source} is nested too deeply to read") from err
    except ValueError as err:  # PyYAML's int() of a number over Python's digit limit
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(prefix, f"{source}: {str(err)[:200]}") from err
    finally:
        loader.dispose()


def read_yaml(path: Path) -> Any:
    """The parsed YAML of a config file (:func:`parse_yaml`); a missing, unreadable, non-UTF-8 or invalid file
    names the path."""
    if not path.is_file():
        raise ConfigError("", f"config file {path} {'does not exist' if not path.exists() else 'is not a file'}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.start + 1]
        raise ConfigError("", f"config file {path} is not UTF-8 text (byte {err.start}: {bad!r})") from err
    except OSError as err:
        raise ConfigError("", f"config file {path} cannot be read: {err.strerror}") from err
    try:
        return parse_yaml(text, str(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError("", f"{path} is not valid YAML: {_yaml_problem(err)}") from err


def _yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line: the problem and where (``line N, column M``)."""
    problem, mark = getattr(err, "problem", None), getattr(err, "problem_mark", None)
    if problem is None:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def copy_sections(raw: dict) -> dict:
    """A copy of the top level and of each section (the loader edits these, never the caller's mapping)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``--set key.path=value`` items (values in YAML syntax) to a copy of the parsed config."""
    raw = copy_sections(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError("", f"--set {shown(item)}: expected key.path=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise ConfigError("", f"--set {shown(item)}: {shown(key.strip())} is not a key path like quant.bits")
        try:
            parsed = parse_yaml(value, f"--set {key.strip()[:SHOWN_CHARS]}", key.strip())
        except yaml.YAMLError as err:
            problem = str(err).splitlines()[0]
            raise ConfigError(
                key.strip(),
                f"--set value {shown(value)} is not valid YAML ({problem}); quote strings, "
                "e.g. --set 'data.dataset=\"my file.txt\"'",
            ) from err
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
    glob characters, or its first component is a folder under ``base`` (``artifacts/nope``). A name the file
    system refuses (too long) counts as local: using it says why."""
    if spec.startswith(("/", ".", "~")) or "\\" in spec or any(ch in spec for ch in "*?["):
        return True
    if spec.count("/") != 1 or spec.endswith(suffixes) or _local_entry(base / spec):
        return True
    return (base / spec.split("/")[0]).is_dir()


def _local_entry(path: Path) -> bool:
    """Whether ``path`` exists, or is a name the file system refuses (too long): local either way, and using it
    says what is wrong."""
    try:
        return path.exists()
    except OSError:
        return True


def resolve_paths(raw: dict, base: Path, keys: tuple[str, ...] = PATH_KEYS) -> dict:
    """Make the local paths among ``keys`` (of PATH_KEYS) absolute against ``base``; hub ids stay as they are."""
    for key in keys:
        section, name = key.split(".")
        node = raw.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value.strip():
            continue
        if (
            key == "output.dir"
            or (key == "model.name_or_path" and looks_local(value, base))
            or (key == "data.dataset" and node.get("type") != "hub" and _local_dataset(value, base))
        ):
            node[name] = _absolute(value, base)
    return raw


def _local_dataset(spec: str, base: Path) -> bool:
    """A bare name (``wikitext``) that is no file here is a hub dataset; otherwise as :func:`looks_local`."""
    bare = "/" not in spec and not spec.startswith((".", "~")) and not any(ch in spec for ch in "*?[")
    if bare and not spec.endswith(LOCAL_DATA_SUFFIXES) and not _local_entry(base / spec):
        return False
    return looks_local(spec, base, LOCAL_DATA_SUFFIXES)


def _absolute(spec: str, base: Path) -> str:
    """``spec`` (``~`` expanded) against ``base``, normalised (``a/../b`` -> ``b``)."""
    return os.path.normpath(base / Path(spec).expanduser())
