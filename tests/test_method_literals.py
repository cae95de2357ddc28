"""No quantization method's name as a string literal outside its declaration (loopvq_calib/config/methods.py): every
other module asks the registry. Read from the source with ``ast``: every string literal but docstrings (an f-string
with ``{}`` for its fields) is cut into tokens (runs of letters, digits, ``_``, ``+``, ``-`` and inner dots, so
``tasq.grouping``, ``tasq_weight`` and ``loopvq.json`` are tokens of their own), and a token equal to a registered
name is a finding, except where a name spells something else (:data:`OTHER_MEANINGS`). A name compared with an
expression about a method (``method == "tasq"``) is a finding even there. The checker is run on a small tree that
breaks each rule, so that it cannot pass by finding nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

from loopvq_calib.config.methods import method_names

PACKAGE = ROOT / "loopvq_calib"
REGISTRY = "config/methods.py"  # the one module that spells the names
TOKEN = re.compile(r"(?:[\w+\-]|\.(?=[\w{]))+")
# name -> (module or folder prefix, what the name means there): two names are also words of another vocabulary
OTHER_MEANINGS: dict[str, tuple[tuple[str, str], ...]] = {
    "tasq": (
        ("bundle/", "the block field tasq (docs/bundle-format.md section 2)"),
        ("codes/quantizer.py", "the block field tasq, written by KVQuantizer.meta"),
        ("calibration/fingerprints.py", "the tasq stage"),
        ("calibration/preflight.py", "the tasq stage"),
        ("calibration/stage_table.py", "the tasq stage"),
    ),
    "loopvq": (("bundle/", "the bundle format's name (field format, the safetensors header, the hub tag)"),),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def string_literals(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """(node, text) of every string literal but docstrings; an f-string as one text, ``{}`` for each field."""
    skip = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
            out.append((node, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node, node.value))
    return out


def _method_comparisons(tree: ast.AST) -> set[int]:
    """ids of the literals inside a comparison whose other side is about a method (``q.method in ("cq",)``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and "method" in ast.unparse(node):
            found.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Constant))
    return found


def _other_meaning(module: str, name: str) -> tuple[str, str] | None:
    return next((e for e in OTHER_MEANINGS.get(name, ()) if module.startswith(e[0])), None)


def method_literals(package: Path, names: tuple[str, ...]) -> tuple[list[str], set]:
    """Findings (``module:line name in 'text'``) under ``package``, and the exemptions used."""
    findings, used = [], set()
    for path in sorted(package.rglob("*.py")):
        module = path.relative_to(package).as_posix()
        if module == REGISTRY:
            continue
        tree = ast.parse(path.read_text(), str(path))
        compared = _method_comparisons(tree)
        for node, text in string_literals(tree):
            for name in sorted({t for t in TOKEN.findall(text) if t in names}):
                other = _other_meaning(module, name)
                if id(node) not in compared and other is not None:
                    used.add((name, other))
                else:
                    findings.append((module, node.lineno, f"{module}:{node.lineno} {name} in {text!r}"))
    return [f for _, _, f in sorted(findings)], used


def test_no_method_name_outside_the_registry():
    findings, used = method_literals(PACKAGE, method_names())
    assert findings == [], "ask loopvq_calib.config.methods (get_method, method_names) instead"
    declared = {(name, e) for name, entries in OTHER_MEANINGS.items() for e in entries}
    assert declared - used == set(), "exemptions no literal needs any more: remove them"


def test_the_checker_finds_each_kind_of_literal(tmp_path):
    package = tmp_path / "pkg"
    (package / "config").mkdir(parents=True)
    (package / "bundle").mkdir()
    (package / "config" / "methods.py").write_text('NAMES = ("cq", "tasq")\n')
    (package / "codes.py").write_text(
        '"""Docstrings may name tasq and cq."""\n'
        "def f(q, name):\n"
        '    """So may this one: cq."""\n'
        '    a = q.method in ("cq", "other")\n'
        '    b = f"{name} is not cq."\n'
        '    c = ("tasq.grouping", "tasq_weight", "cq-like", "+tasq", "the tasq stage")\n'
        "    return a, b, c\n"
    )
    (package / "bundle" / "fields.py").write_text(
        'def g(meta, b):\n    return b["tasq"], meta["method"] == "tasq", "cq"\n'
    )
    findings, _ = method_literals(package, ("cq", "tasq"))
    assert findings == [
        "bundle/fields.py:2 cq in 'cq'",
        "bundle/fields.py:2 tasq in 'tasq'",  # compared with a method, even where tasq is the block field
        "codes.py:4 cq in 'cq'",
        "codes.py:5 cq in '{} is not cq.'",
        "codes.py:6 tasq in 'the tasq stage'",
    ]
