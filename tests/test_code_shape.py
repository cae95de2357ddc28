"""Small files and small functions (docs/architecture.md): no Python file of the package, its tests, benchmarks or
scripts over 400 lines, no function over 80 lines but a kernel body (a ``@triton.jit`` function); checked from
the source, with the checker tested on a file that breaks both limits."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

FOLDERS = ("loopvq_calib", "tests", "benchmarks", "scripts")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel (``@triton.jit``, with or without arguments): its body is the kernel, exempt."""
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def oversized(path: Path, label: str) -> list[str]:
    """Lines naming every limit ``path`` breaks."""
    text = path.read_text()
    out = []
    lines = len(text.splitlines())
    if lines > MAX_FILE_LINES:
        out.append(f"{label}: {lines} lines (at most {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_kernel(node):
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                out.append(f"{label}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return out


def test_files_and_functions_stay_small():
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += oversized(path, str(path.relative_to(ROOT)))
    assert found == []


def test_the_checker_reports_a_long_file_and_a_long_function_but_not_a_kernel(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    source = f"import triton\n\n\ndef long_function():\n{body}\n\n@triton.jit\ndef kernel():\n{body}\n" + "\n" * 300
    path = tmp_path / "big.py"
    path.write_text(source)
    assert oversized(path, "big.py") == [
        f"big.py: {len(source.splitlines())} lines (at most 400)",
        "big.py:4 long_function: 86 lines (at most 80)",
    ]
