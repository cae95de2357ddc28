"""The public API of ``loopvq_calib``: every name of ``__all__`` resolves to the object its module defines, the
names type checkers see (the ``TYPE_CHECKING`` imports) are exactly ``__all__``, and importing the package loads
neither torch nor transformers."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

from conftest import ROOT

import loopvq_calib


def test_every_public_name_is_the_object_its_module_defines():
    for name in loopvq_calib.__all__:
        module = loopvq_calib._LAZY.get(name, "version")
        if module is None:
            assert getattr(loopvq_calib, name) is importlib.import_module(f"loopvq_calib.{name}")
        else:
            assert getattr(loopvq_calib, name) is getattr(importlib.import_module(f"loopvq_calib.{module}"), name)
    assert sorted(dir(loopvq_calib)) == sorted(loopvq_calib.__all__)


def test_type_checkers_see_exactly_the_public_names():
    tree = ast.parse((ROOT / "loopvq_calib" / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {alias.asname or alias.name for node in guarded.body for alias in node.names}
    assert seen | {"__version__"} == set(loopvq_calib.__all__) == set(loopvq_calib._LAZY) | {"__version__"}


def test_importing_the_package_loads_no_heavy_library():
    code = "import sys, loopvq_calib; print(*(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == ""
