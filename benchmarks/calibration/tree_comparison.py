"""The shipped command from two trees on one machine, from the stored output of
`benchmarks/calibration/compare_trees.sh` (``benchmarks/results/compare-trees-<machine>-<earlier>-vs-<later>.jsonl``):
per file, each tree's median whole-command seconds over its rounds and the later tree's change against the earlier."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from benchmarks.common.markdown import wrap

NAME = re.compile(r"compare-trees-(?P<machine>[a-z0-9]+)-(?P<other>[0-9a-f]{7,40})-vs-(?P<this>[0-9a-f]{7,40})\.jsonl")


def comparison_rows(results: Path) -> list[dict]:
    """One row per stored comparison file (sorted by name): machine, both commits, rounds, median seconds."""
    rows = []
    for path in sorted(results.glob("compare-trees-*.jsonl")):
        named = NAME.fullmatch(path.name)
        if named is None:
            continue
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        seconds = {
            tree: [r["command_s"] for r in runs if r["tree"] == tree and r["rc"] == 0] for tree in ("other", "this")
        }
        if not all(seconds.values()):
            continue
        rows.append(
            {
                "file": path.name,
                "machine": named["machine"],
                "earlier": named["other"],
                "later": named["this"],
                "rounds": min(len(v) for v in seconds.values()),
                "earlier_s": statistics.median(seconds["other"]),
                "later_s": statistics.median(seconds["this"]),
            }
        )
    return rows


def comparison_section(results: Path) -> list[str]:
    """The page's section: a table of :func:`comparison_rows` (none when no file is stored)."""
    rows = comparison_rows(results)
    if not rows:
        return []
    lines = [
        "## The shipped command against an earlier tree",
        "",
        wrap(
            "The shipped Ouro-1.4B command (random weights of the real shapes) from two checkouts in turn on one "
            "machine, the earlier tree first (`benchmarks/calibration/compare_trees.sh OUT EARLIER_TREE ROUNDS "
            "configs/ouro-1.4b.yaml ouro-1.4b`): the median whole-command seconds of each tree. Compare trees only "
            "within a row: each row is one machine."
        ),
        "",
        "| machine | earlier tree | later tree | rounds | earlier s | later s | change | file |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        change = r["later_s"] / r["earlier_s"] - 1
        lines.append(
            f"| {r['machine']} | `{r['earlier']}` | `{r['later']}` | {r['rounds']} | {r['earlier_s']:.1f} | "
            f"{r['later_s']:.1f} | {change:+.1%} | `{r['file']}` |"
        )
    return lines
