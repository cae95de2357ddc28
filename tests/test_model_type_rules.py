"""Model knowledge stays in ``models/`` (docs/architecture.md, "Adding a looped architecture"), read from the source:
outside that folder no module compares a ``model_type`` with anything but another record's ``model_type`` (a
consistency check, as the bundle reader's), looks a table up by it, matches on it, writes a registered model type as
a string, or names an architecture's module or classes. Callers ask the registry or the model's hooks instead. The
checker is tested on a tree that breaks every rule (today's served.py branch among them), so that it cannot pass by
finding nothing."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

from loopvq_calib.models import model_types
from loopvq_calib.models.registry import find_architecture

PACKAGE = "loopvq_calib"
HOME = "models"  # the one folder that knows architectures


@dataclass(frozen=True)
class Known:
    """What names an architecture: its model type, its module, its config and model classes."""

    types: frozenset[str]
    modules: frozenset[str]
    classes: frozenset[str]


def registered() -> Known:
    """The architectures registered with the toolkit."""
    archs = [find_architecture(t) for t in model_types()]
    return Known(
        frozenset(model_types()),
        frozenset(a.model_class.__module__.rsplit(".", 1)[-1] for a in archs),
        frozenset(n for a in archs for n in (a.config_class.__name__, a.model_class.__name__)),
    )


def reads_model_type(node: ast.AST) -> bool:
    """``x.model_type``, ``model_type``, ``x["model_type"]``, ``x.get("model_type")``, ``getattr(x, "model_type")``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "model_type"
    if isinstance(node, ast.Name):
        return node.id == "model_type"
    if isinstance(node, ast.Subscript):
        return _is_text(node.slice, "model_type")
    if isinstance(node, ast.Call):
        getter = isinstance(node.func, ast.Attribute) and node.func.attr == "get"
        getter |= isinstance(node.func, ast.Name) and node.func.id == "getattr"
        return getter and any(_is_text(a, "model_type") for a in node.args)
    return False


def _is_text(node: ast.AST, text: str | set[str]) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in ({text} if isinstance(text, str) else text)
    )


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def branches(tree: ast.AST, known: Known) -> Iterator[tuple[int, str]]:
    """(line, what) of every place ``tree`` branches on an architecture."""
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare):
            reads = [reads_model_type(n) for n in (node.left, *node.comparators)]
            if any(reads) and not all(reads):
                yield line, "compares model_type"
        elif _looks_up_by_model_type(node):
            yield line, "looks a table up by model_type"
        elif isinstance(node, ast.Match) and reads_model_type(node.subject):
            yield line, "matches on model_type"
        elif _is_text(node, set(known.types)) and id(node) not in docstrings:
            yield line, f"writes the model type {node.value!r}"
        elif isinstance(node, ast.Name) and node.id in known.classes:
            yield line, f"names {node.id}"
        elif isinstance(node, ast.Attribute) and node.attr in known.classes:
            yield line, f"names {node.attr}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((line, f"imports {name}") for name in _imported(node) if name in known.modules | known.classes)


def _looks_up_by_model_type(node: ast.AST) -> bool:
    """``table[x.model_type]`` or ``table.get(x.model_type)``."""
    if isinstance(node, ast.Subscript):
        return reads_model_type(node.slice)
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and any(reads_model_type(a) for a in node.args)
    )


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """Every dotted part an import names: its module's and each imported name's."""
    module = node.module.split(".") if isinstance(node, ast.ImportFrom) and node.module else []
    return module + [part for alias in node.names for part in alias.name.split(".")]


def violations(root: Path, known: Known) -> list[str]:
    """``file:line: what`` for every architecture branch outside ``models/`` of the package under ``root``."""
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root / PACKAGE)
        if rel.parts[0] != HOME:
            tree = ast.parse(path.read_text(), str(path))
            out += [f"{rel.as_posix()}:{line}: {what}" for line, what in sorted(set(branches(tree, known)))]
    return out


def test_no_module_outside_models_branches_on_an_architecture():
    assert violations(ROOT, registered()) == []


def test_the_checker_reports_each_kind_of_branch(tmp_path):
    """Today's served.py branch and one of each other kind are found; models/ and a record consistency check are
    left alone."""
    files = {
        "models/loading.py": 'def steps(m):\n    return "t" if m.config.model_type == "ouro" else "r"\n',
        "evaluation/served.py": (
            'def details(model):\n    """For Huginn (huginn_raven) the recurrences."""\n'
            '    cfg = model.config\n    if cfg.model_type == "huginn_raven":\n        pass\n'
        ),
        "data/window.py": (
            'WINDOW = {"ouro": "max_position_embeddings"}\n\n\ndef window(cfg):\n'
            "    return WINDOW[cfg.model_type], WINDOW.get(cfg.model_type)\n"
        ),
        "serving/kinds.py": (
            "from ..models.huginn import HuginnForCausalLM\n\n\ndef looped(model, raw, model_type):\n"
            '    match raw["model_type"]:\n        case _:\n            pass\n'
            "    return isinstance(model, HuginnForCausalLM) or model_type in KNOWN\n"
        ),
        "bundle/validate.py": 'def same(model, kv):\n    return model["model_type"] != kv["model_type"]\n',
    }
    for rel, text in files.items():
        (tmp_path / PACKAGE / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / PACKAGE / rel).write_text(text)
    found = violations(
        tmp_path,
        Known(frozenset({"ouro", "huginn_raven"}), frozenset({"ouro", "huginn"}), frozenset({"HuginnForCausalLM"})),
    )
    assert found == [
        "data/window.py:1: writes the model type 'ouro'",
        "data/window.py:5: looks a table up by model_type",
        "evaluation/served.py:4: compares model_type",
        "evaluation/served.py:4: writes the model type 'huginn_raven'",
        "serving/kinds.py:1: imports HuginnForCausalLM",
        "serving/kinds.py:1: imports huginn",
        "serving/kinds.py:5: matches on model_type",
        "serving/kinds.py:8: compares model_type",
        "serving/kinds.py:8: names HuginnForCausalLM",
    ]
