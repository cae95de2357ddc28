"""The fuzz table (tests/test_fuzz.py), configs: ``--set`` values out of range or of the wrong type, config files
that are not UTF-8, YAML or a mapping, YAML anchors, aliases, merge keys, duplicate keys and deep nesting, unknown
stages. Each case exits 2, naming it in one short line, and writes and deletes nothing (support/fuzz.py)."""

from __future__ import annotations

import pytest
from support.fuzz import (
    Case,
    assert_refused,
    case_ids,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib.cli import calibrate_main

CASES: list[Case] = [
    # -- configs and --set -----------------------------------------------------------------------------
    (
        "set-unparsable-yaml",
        lambda ws: ws.run_with("--set", "quant.bits=[0.5"),
        2,
        "quant.bits: --set value '[0.5' is not valid YAML",
    ),
    ("set-no-equals", lambda ws: ws.run_with("--set", "quant.bits"), 2, "--set 'quant.bits': expected key.path=value"),
    ("set-empty-key-part", lambda ws: ws.run_with("--set", "quant..bits=1"), 2, "is not a key path like quant.bits"),
    ("set-unknown-key", lambda ws: ws.run_with("--set", "quant.bogus=1"), 2, "quant.bogus: unknown key"),
    ("set-section-as-value", lambda ws: ws.run_with("--set", "quant=3"), 2, "quant: expected a mapping, got int"),
    ("lr-nan", lambda ws: ws.run_with("--set", "finetune.lr=.nan"), 2, "finetune.lr: must be a finite number, got nan"),
    ("lr-string-nan", lambda ws: ws.run_with("--set", "finetune.lr=nan"), 2, "finetune.lr: must be a finite number"),
    (
        "tolerance-inf",
        lambda ws: ws.run_with("--set", "kmeans.tolerance=.inf"),
        2,
        "kmeans.tolerance: must be a finite number, got inf",
    ),
    (
        "kmeans-seed-negative",
        lambda ws: ws.run_with("--set", "kmeans.seed=-1"),
        2,
        "kmeans.seed: must be in [0, 2**32), got -1",
    ),
    ("data-seed-huge", lambda ws: ws.run_with("--set", "data.seed=4294967296"), 2, "data.seed: must be in [0, 2**32)"),
    (
        "finetune-seed-negative",
        lambda ws: ws.run_with("--set", "finetune.seed=-5"),
        2,
        "finetune.seed: must be in [0, 2**32)",
    ),
    (
        "num-sequences-float",
        lambda ws: ws.run_with("--set", "data.num_sequences=1e12"),
        2,
        "data.num_sequences: expected int",
    ),
    (
        "num-sequences-huge",
        lambda ws: ws.run_with("--set", "data.num_sequences=99999999999"),
        2,
        "data.num_sequences: 99999999999 is out of range",
    ),
    (
        "group-size-zero",
        lambda ws: ws.run_with("--set", "quant.group_size=0", "--set", "quant.bits=null"),
        2,
        "quant.group_size: must be > 0",
    ),
    (
        "codebook-size-3",
        lambda ws: ws.run_with("--set", "quant.codebook_size=3"),
        2,
        "quant.codebook_size: must be a power of two",
    ),
    ("sigma-min-zero", lambda ws: ws.run_with("--set", "tasq.sigma_min=0"), 2, "tasq.sigma_min: must be > 0"),
    (
        "weight-floor-above-1",
        lambda ws: ws.run_with("--set", "tasq.weight_floor=1.5"),
        2,
        "tasq.weight_floor: is a fraction",
    ),
    (
        "page-size-zero",
        lambda ws: ws.run_with("--set", "output.serving.page_size=0"),
        2,
        "output.serving.page_size: must be > 0",
    ),
    (
        "bundle-name-with-slash",
        lambda ws: ws.run_with("--set", "output.bundle_name=a/b"),
        2,
        "output.bundle_name: 'a/b'",
    ),
    (
        "config-not-utf8",
        lambda ws: (calibrate_main, ["--config", ws.file("latin1.yaml", b"quant:\n  method: caf\xe9\n")]),
        2,
        "latin1.yaml is not UTF-8 text (byte 20",
    ),
    (
        "config-bad-yaml",
        lambda ws: (calibrate_main, ["--config", ws.file("bad.yaml", "quant: [1,\n")]),
        2,
        "bad.yaml is not valid YAML",
    ),
    (
        "config-missing",
        lambda ws: (calibrate_main, ["--config", str(ws.root / "none.yaml")]),
        2,
        "none.yaml does not exist",
    ),
    ("config-is-folder", lambda ws: (calibrate_main, ["--config", str(ws.root)]), 2, "is not a file"),
    (
        "config-top-level-list",
        lambda ws: (calibrate_main, ["--config", ws.file("list.yaml", "- a\n")]),
        2,
        "must be a mapping of sections, got list",
    ),
    ("stages-unknown", lambda ws: ws.run_with("--stages", "data,bogus"), 2, "--stages: unknown stage(s) 'bogus'"),
    (
        "stages-tasq-for-loopvq",
        lambda ws: ws.run_with("--stages", "tasq"),
        2,
        "tasq stage exists only for quant.method tasq",
    ),
    (
        "group-size-vs-head-dim",
        lambda ws: ws.run_with(
            "--set",
            "quant.method=cq",
            "--set",
            "quant.group_size=32",
            "--set",
            "quant.bits=null",
            "--set",
            "quant.codebook_size=256",
        ),
        2,
        "head_dim 16 is not divisible by group_size = 32",
    ),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    (
        "yaml-anchor-alias",
        lambda ws: (calibrate_main, ["--config", ws.file("a.yaml", "quant:\n  bits: &a [0.5]\nkmeans:\n  seed: *a\n")]),
        2,
        "quant.bits: YAML anchors and aliases are not allowed (&a at {}/a.yaml line 2)",
    ),
    (
        "yaml-alias-bomb-in-set",
        lambda ws: ws.run_with("--set", "quant.bits=[&a0 [1, 1], &a1 [*a0, *a0], &a2 [*a1, *a1]]"),
        2,
        "quant.bits[0]: YAML anchors and aliases are not allowed (&a0 at --set quant.bits)",
    ),
    (
        "yaml-duplicate-section",
        lambda ws: (
            calibrate_main,
            ["--config", ws.file("d.yaml", "quant:\n  method: cq\nquant:\n  method: loopvq\n")],
        ),
        2,
        "quant: duplicate key ({}/d.yaml line 1 and line 3)",
    ),
    (
        "yaml-duplicate-key",
        lambda ws: (calibrate_main, ["--config", ws.file("d.yaml", "quant:\n  method: cq\n  method: loopvq\n")]),
        2,
        "quant.method: duplicate key ({}/d.yaml line 2 and line 3)",
    ),
    (
        "yaml-too-deep",
        lambda ws: ws.run_with("--set", "quant.bits=" + "[" * 20_000 + "]" * 20_000),
        2,
        "nested deeper than 32 levels (--set quant.bits)",
    ),
    # -- what a file or a value can say: configs -------------------------------------------------------
    (
        "yaml-merge-key",
        lambda ws: (calibrate_main, ["--config", ws.file("m.yaml", "quant:\n  <<: {method: cq}\n  method: loopvq\n")]),
        2,
        "quant: YAML merge keys (<<) are not allowed (<< at {}/m.yaml line 2)",
    ),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)
