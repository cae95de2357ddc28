"""Where an import's time goes, from a ``python -X importtime`` log: the slowest direct children of a module
(cumulative microseconds as Python reports them), and for each heavy package the chain of imports that first
pulled it in. One JSON object.

    python -X importtime -c "from loopvq_calib.calibration.pipeline import Pipeline" 2> importtime.txt
    python scripts/importtime_report.py importtime.txt --module loopvq_calib.calibration.pipeline
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
HEAVY = ("torch", "transformers", "sympy", "sklearn", "scipy", "pandas", "torch._dynamo", "accelerate", "datasets",
         "lm_eval", "matplotlib", "huggingface_hub", "triton")


def read(path: Path) -> list[tuple[int, int, str]]:
    """(cumulative us, depth, module) in the order Python wrote them (a module after its children)."""
    rows = []
    for line in path.read_text().splitlines():
        m = LINE.match(line)
        if m:
            rows.append((int(m[2]), len(m[3]) // 2, m[4]))
    return rows


def children(rows: list[tuple[int, int, str]], name: str, top: int) -> list[tuple[str, float]]:
    """The ``top`` slowest modules imported directly by the first import of ``name`` (seconds)."""
    for i, (_, depth, module) in enumerate(rows):
        if module == name:
            out, j = [], i - 1
            while j >= 0 and rows[j][1] > depth:
                if rows[j][1] == depth + 1:
                    out.append((rows[j][2], round(rows[j][0] / 1e6, 3)))
                j -= 1
            return sorted(out, key=lambda c: -c[1])[:top]
    return []


def chain(rows: list[tuple[int, int, str]], name: str) -> list[str]:
    """The importers of the first import of ``name``, innermost first, each with its cumulative seconds."""
    for i, (us, depth, module) in enumerate(rows):
        if module == name:
            out = [f"{module} {us / 1e6:.2f}"]
            for cum, d, parent in rows[i + 1:]:
                if d < depth:
                    out.append(f"{parent} {cum / 1e6:.2f}")
                    depth = d
            return out
    return []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--module", action="append", default=[], help="list the slowest direct imports of this module")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    rows = read(args.log)
    report = {"top_level_s": round(sum(us for us, depth, _ in rows if depth == 0) / 1e6, 2),
              "children": {m: children(rows, m, args.top) for m in args.module},
              "first_imported_by": {p: chain(rows, p) for p in HEAVY if any(m == p for _, _, m in rows)}}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
