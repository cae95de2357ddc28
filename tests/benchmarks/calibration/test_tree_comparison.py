"""benchmarks/calibration/tree_comparison.py: the performance page's two-tree section from stored
compare_trees.sh output."""

from __future__ import annotations

import json

from benchmarks.calibration import tree_comparison as tc


def _write(path, runs):
    path.write_text(
        "".join(
            json.dumps({"tree": t, "round": i, "rc": rc, "command_s": s}) + "\n" for i, (t, rc, s) in enumerate(runs)
        )
    )


def test_rows_take_each_trees_median_of_its_finished_rounds(tmp_path):
    """Medians per tree over rounds with exit status 0 (a failed round does not count), the commits and machine
    from the file name; a file of another name or one tree without a finished round gives no row."""
    _write(
        tmp_path / "compare-trees-h100-d6b9c55-vs-b739aaa.jsonl",
        [
            ("other", 0, 50.0),
            ("this", 0, 51.0),
            ("other", 0, 54.0),
            ("this", 0, 53.0),
            ("this", 1, 10.0),
            ("other", 0, 70.0),
        ],
    )
    _write(tmp_path / "compare-trees-h200-aaaaaaa-vs-bbbbbbb.jsonl", [("other", 0, 5.0), ("this", 1, 4.0)])
    _write(tmp_path / "compare-trees-notes.jsonl", [("other", 0, 5.0), ("this", 0, 4.0)])
    (row,) = tc.comparison_rows(tmp_path)
    assert row == {
        "file": "compare-trees-h100-d6b9c55-vs-b739aaa.jsonl",
        "machine": "h100",
        "earlier": "d6b9c55",
        "later": "b739aaa",
        "rounds": 2,
        "earlier_s": 54.0,
        "later_s": 52.0,
    }
    section = tc.comparison_section(tmp_path)
    assert section[0] == "## The shipped command against an earlier tree"
    assert section[-1] == (
        "| h100 | `d6b9c55` | `b739aaa` | 2 | 54.0 | 52.0 | -3.7% | `compare-trees-h100-d6b9c55-vs-b739aaa.jsonl` |"
    )


def test_no_stored_comparison_gives_no_section(tmp_path):
    assert tc.comparison_section(tmp_path) == []
