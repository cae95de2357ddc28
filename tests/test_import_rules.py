"""The package's import rules (docs/architecture.md), read from the source: which folder may import which, no
import circles, no imports inside functions but of optional heavy libraries and the CLI's lazy start, and only
``__init__``, ``__main__`` and ``version`` at the top of the package. The checker is tested on a tree that breaks
every rule, so that it cannot pass by finding nothing."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from conftest import ROOT

PACKAGE = "loopvq_calib"
# folder -> the folders its modules may import (besides their own); the CLI (FACES) and the package's top import
# anything
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "runtime": set(),
    "models": {"config", "runtime"},
    "data": {"config", "models", "runtime"},
    "kernels": {"models", "runtime"},
    "codes": {"config", "kernels", "models", "runtime"},
    "bundle": {"codes", "config", "models", "runtime"},
    "serving": {"codes", "kernels", "models", "runtime"},
    "evaluation": {"bundle", "codes", "config", "data", "kernels", "models", "runtime", "serving"},
    "calibration": {"bundle", "codes", "config", "data", "kernels", "models", "runtime"},
}
TOP_LEVEL = {"__init__", "__main__", "version"}  # modules allowed at the package's top
FACES = {"cli"}  # folders that may import every other one: the console scripts
IMPORTABLE_EVERYWHERE = {f"{PACKAGE}.version"}  # the one place the version is written
# optional heavy libraries, imported where they are needed: an extra (lm_eval, faiss, triton), or a library
# only some inputs need (datasets for hub datasets, pyarrow for parquet files, matplotlib for the report's plots;
# the GPU image has no datasets)
OPTIONAL_HEAVY = {"lm_eval", "faiss", "triton", "matplotlib", "datasets", "pyarrow"}
LAZY_FOLDERS = {"cli"}  # import what a command runs on demand (a console script's --help stays light)
SKIPPED = ("evaluation/tasks/",)  # lm-eval task folders: data and the loaders lm-eval imports itself


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module of the package, or an outside top-level name
    line: int
    in_function: bool


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root / PACKAGE``."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root / PACKAGE).as_posix()
        if not rel.startswith(SKIPPED):
            out[module_name(root, path)] = path
    return out


def _inside_functions(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import in module ``name``: targets inside the package resolved to modules (``from pkg import mod``
    names the submodule), outside ones as their top-level name."""
    tree = ast.parse(path.read_text(), str(path))
    inside = _inside_functions(tree)
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = here[: len(here) - node.level + 1]
                base = ".".join(prefix + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] != PACKAGE:
                target = target.split(".")[0]
            else:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
            found.append(Import(name, target, node.lineno, id(node) in inside))
    return found


def folder_of(module: str, modules: dict[str, Path], root: Path) -> str:
    """The package folder a module lives in ("" for the package's top-level modules)."""
    parts = modules[module].relative_to(root / PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in edges.get(v, ()):
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def violations(root: Path) -> list[str]:
    """Every broken rule of the package under ``root``, one line each (empty: the rules hold)."""
    modules = package_modules(root)
    out = []
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        if path.parent == root / PACKAGE and path.stem not in TOP_LEVEL:
            out.append(f"{name}: a module at the top of the package (put it in the folder of its concern)")
        src = folder_of(name, modules, root)
        for imp in imports_of(name, path, modules):
            where = f"{name}:{imp.line}"
            if not imp.target.startswith(PACKAGE):
                if imp.in_function and imp.target not in OPTIONAL_HEAVY and src not in LAZY_FOLDERS:
                    out.append(f"{where}: imports {imp.target} inside a function")
                continue
            if imp.in_function and src not in LAZY_FOLDERS:
                out.append(f"{where}: imports {imp.target} inside a function")
            edges.setdefault(name, set()).add(imp.target)
            dst = folder_of(imp.target, modules, root)
            allowed = src in FACES or dst in ALLOWED.get(src, set()) or imp.target in IMPORTABLE_EVERYWHERE
            if src and src != dst and not allowed:
                out.append(f"{where}: {src} must not import {dst or 'the package top'} ({imp.target})")
    out += [f"import circle: {' <-> '.join(c)}" for c in circles(edges)]
    return list(dict.fromkeys(out))  # one line per broken rule (an import of several names is one import)


def test_the_package_keeps_its_import_rules():
    assert violations(ROOT) == []


def test_the_checker_reports_each_kind_of_broken_rule(tmp_path):
    """A small package that breaks every rule once: a top-level module, a forbidden arrow (kernels -> calibration),
    a circle, an import inside a function and an arrow into the CLI; each is reported, and a clean module (the
    CLI's lazy start among them) is not."""
    pkg = tmp_path / PACKAGE
    files = {
        "__init__.py": "",
        "cli/__init__.py": "",
        "cli/run.py": (
            "def main():\n    import torch\n    from ..calibration import stage  # the CLI's lazy start: allowed\n"
        ),
        "helpers.py": "",
        "kernels/__init__.py": "",
        "kernels/fast.py": "from ..calibration import stage\n",
        "calibration/__init__.py": "",
        "calibration/stage.py": "from . import plan\nfrom ..kernels import fast\n",
        "calibration/plan.py": (
            "from .stage import run\n\ndef later():\n    import json\n    from ..codes import codec\n"
        ),
        "codes/__init__.py": "",
        "codes/codec.py": "from ..kernels import fast\n\ndef decode():\n    import triton  # optional heavy: allowed\n",
        "serving/__init__.py": "",
        "serving/cache.py": "from ..cli import run\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    found = violations(tmp_path)
    assert "loopvq_calib.helpers: a module at the top of the package (put it in the folder of its concern)" in found
    assert "loopvq_calib.kernels.fast:1: kernels must not import calibration (loopvq_calib.calibration.stage)" in found
    assert (
        "import circle: loopvq_calib.calibration.plan <-> loopvq_calib.calibration.stage <-> "
        "loopvq_calib.codes.codec <-> loopvq_calib.kernels.fast"
    ) in found
    assert "loopvq_calib.calibration.plan:4: imports json inside a function" in found
    assert "loopvq_calib.calibration.plan:5: imports loopvq_calib.codes.codec inside a function" in found
    assert "loopvq_calib.serving.cache:1: serving must not import cli (loopvq_calib.cli.run)" in found
    assert not [line for line in found if line.startswith(("loopvq_calib.cli", "loopvq_calib.codes"))]
    assert len(found) == 6
