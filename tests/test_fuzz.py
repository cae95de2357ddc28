"""A table of bad inputs: each must exit 2 (3 where the push itself fails) with a short message naming the key,
file, field or site, write nothing and delete nothing (docs/reliability.md). The CLI functions run in-process; a
real second process is used only where it is the point (a run holding the lock). The inputs are built by
tests/support/fuzz.py.

Cases that do not exit 2, covered elsewhere:
- SIGINT (130) or SIGTERM (143) during the capture, one line on the console and the traceback in run.log:
  tests/cli/test_exits.py::test_a_signal_during_the_capture_exits_with_its_status_one_line_and_the_traceback_in_run_log
- a stage file corrupted in place at the same size reruns its stage with one warning naming it:
  tests/calibration/test_stage_hashes.py::test_a_file_corrupted_in_place_at_its_size_reruns_its_stage_with_a_warning
- a failed stage (3) is the one that raised, never one an older record names:
  tests/calibration/test_pipeline_failures.py::test_the_console_names_the_stage_that_raised_not_a_stale_record
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from support.fuzz import (
    DEEP,
    JSONL,
    Setup,
    Workspace,
    cut_shard,
    edit_meta,
    eval_with_window,
    header_version,
    hold_lock,
    linked_lock,
    listed,
    manifest_entry,
    manifest_folder_entry,
    mistyped_model_path,
    model_copy,
    offline_push,
    output_holding_a_link,
    parquet_bytes,
    report_push,
    reseal,
    shards_without_the_second,
    symlinked_card,
    through_linked_folder,
    tiny_eval,
    truncate,
    window,
)

from loopvq_calib import cli
from loopvq_calib.bundle import hub, reader
from loopvq_calib.calibration.rundir import LOCK_FILE
from loopvq_calib.cli import calibrate_main, eval_main, inspect_main, push_main

MAX_MESSAGE = 2_000  # characters on stderr: no message shows an unbounded value

NO_CUDA = not torch.cuda.is_available()

# (id, setup(ws) -> (main, argv), exit status, fragment of stderr)
CASES: list[tuple[str, Setup, int, str]] = [
    # -- configs and --set -------------------------------------------------------------------------
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
    # -- models and devices ------------------------------------------------------------------------
    ("model-relative-typo", lambda ws: mistyped_model_path(ws), 2, "model.name_or_path: no such folder:"),
    (
        "model-absolute-missing",
        lambda ws: ws.run_with("--set", f"model.name_or_path={ws.root / 'nope'}"),
        2,
        "no such folder",
    ),
    (
        "model-hub-offline",
        lambda ws: ws.run_with("--set", "model.name_or_path=someorg/not-cached"),
        2,
        "is not in the local hub cache",
    ),
    (
        "model-no-config-json",
        lambda ws: ws.run_with("--set", f"model.name_or_path={Path(ws.file('empty-model/x.txt', 'x')).parent}"),
        2,
        "has no config.json",
    ),
    (
        "model-unsupported-type",
        lambda ws: ws.run_with(
            "--set",
            f"model.name_or_path={Path(ws.file('llama/config.json', json.dumps({'model_type': 'llama'}))).parent}",
        ),
        2,
        "model_type 'llama'",
    ),
    pytest.param(
        "model-device-cuda",
        lambda ws: ws.run_with("--set", "model.device=cuda"),
        2,
        "model.device: 'cuda' asked for, but no CUDA",
        marks=pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA"),
    ),
    (
        "kmeans-device-bad",
        lambda ws: ws.run_with("--set", "kmeans.device=gpu"),
        2,
        "kmeans.device: 'gpu' is not allowed",
    ),
    # -- corpora -----------------------------------------------------------------------------------
    ("corpus-empty", lambda ws: ws.data("empty.jsonl", ""), 2, "data.dataset: " + "{}/empty.jsonl holds no text"),
    ("corpus-whitespace", lambda ws: ws.data("blank.jsonl", json.dumps({"text": "   "}) + "\n"), 2, "holds no text"),
    (
        "corpus-jsonl-not-utf8",
        lambda ws: ws.data("l1.jsonl", b'{"text": "caf\xe9"}\n'),
        2,
        "l1.jsonl is not UTF-8 text: byte offset 13",
    ),
    (
        "corpus-txt-not-utf8",
        lambda ws: ws.data("l1.txt", b"ok\n\xff\xfe"),
        2,
        "l1.txt is not UTF-8 text: byte offset 3",
    ),
    (
        "corpus-broken-jsonl",
        lambda ws: ws.data("broken.jsonl", JSONL + "{not json\n"),
        2,
        "broken.jsonl line 41 is not a JSON object",
    ),
    (
        "corpus-json-array-broken",
        lambda ws: ws.data("broken.json", '[{"text": "a"},'),
        2,
        "broken.json is not valid JSON",
    ),
    (
        "corpus-no-text-field",
        lambda ws: ws.data("body.jsonl", json.dumps({"body": "x"}) + "\n"),
        2,
        "data.text_field: column 'text' not in",
    ),
    (
        "corpus-parquet-no-column",
        lambda ws: ws.data("p.parquet", parquet_bytes()),
        2,
        "data.text_field: column 'text' not in",
    ),
    (
        "corpus-parquet-garbage",
        lambda ws: ws.data("g.parquet", b"PAR1 this is not parquet"),
        2,
        "g.parquet is not a readable parquet file",
    ),
    (
        "corpus-too-small",
        lambda ws: ws.data("small.jsonl", json.dumps({"text": "tiny"}) + "\n"),
        2,
        "only 0 windows of 32 tokens (data.sequence_length); 6 were asked for",
    ),
    (
        "corpus-missing",
        lambda ws: ws.run_with("--set", f"data.dataset={ws.root / 'none.jsonl'}"),
        2,
        "data.dataset: no local file matches",
    ),
    (
        "corpus-empty-folder",
        lambda ws: ws.run_with("--set", f"data.dataset={Path(ws.file('corp/readme.md', '#')).parent}"),
        2,
        "holds no .txt",
    ),
    ("corpus-unknown-suffix", lambda ws: ws.data("notes.md", "# x"), 2, "cannot infer the file type"),
    # -- output folders, run directories, locks ----------------------------------------------------
    (
        "output-is-a-file",
        lambda ws: ws.run_with("--output", ws.file("afile", "x")),
        2,
        "afile exists and is not a directory",
    ),
    (
        "output-user-folder",
        lambda ws: ws.run_with("--output", str(Path(ws.file("P/data/train.csv", "x")).parents[1]), "--stages", "data"),
        2,
        "is not empty and is not a loopvq-calibrate run directory",
    ),
    (
        "output-user-tmp-folder",
        lambda ws: ws.run_with("--output", str(Path(ws.file("Q/.backup.tmp/thesis.txt", "x")).parents[1])),
        2,
        "holds .backup.tmp",
    ),
    (
        "output-under-a-file",
        lambda ws: ws.run_with("--output", ws.file("afile", "x") + "/sub"),
        2,
        "output.dir: cannot use",
    ),
    (
        "rundir-user-file-in-stage",
        lambda ws: (ws.run_dir({"data/mine.csv": "x"}), ws.run_with("--stages", "data"))[1],
        2,
        "holds files this toolkit did not write (mine.csv)",
    ),
    (
        "rundir-user-folder-as-stage",
        lambda ws: (ws.run_dir({"capture/notes.txt": "x"}), ws.run_with("--stages", "capture"))[1],
        2,
        "run/capture holds files this toolkit did not write (notes.txt)",
    ),
    (
        "rundir-bad-manifest",
        lambda ws: (ws.run_dir({"manifest.json": "{"}), ws.run_with())[1],
        2,
        "manifest.json is not valid JSON",
    ),
    ("rundir-locked", hold_lock, 2, "is in use by another loopvq-calibrate run (pid"),
    # -- bundles: inspect, push, eval --------------------------------------------------------------
    (
        "bundle-edited-name",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("name",), "other"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-edited-config-sha",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "config_sha256"), "0" * 64))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-edited-model-type",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "model_type"), "llama"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-bad-meta-sha",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("meta_sha256",), "xyz"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-truncated-codebooks",
        lambda ws: (inspect_main, [ws.bundle(truncate("codebooks.safetensors"))]),
        2,
        "size mismatch",
    ),
    (
        "bundle-edited-card",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "README.md").write_text("x"))]),
        2,
        "README.md: size mismatch",
    ),
    (
        "bundle-meta-not-json",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_bytes(b"\xff"))]),
        2,
        "loopvq.json: not valid JSON",
    ),
    ("bundle-missing-folder", lambda ws: (inspect_main, [str(ws.root / "nope")]), 2, "nope: no such bundle folder"),
    ("bundle-hub-offline", lambda ws: (inspect_main, ["someorg/not-cached-bundle"]), 2, "not in the local hub cache"),
    (
        "push-edited-bundle",
        lambda ws: (push_main, [ws.bundle(edit_meta(("name",), "x")), "--repo-id", "org/x", "--dry-run"]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "push-bad-repo-id",
        lambda ws: (push_main, [ws.bundle(), "--repo-id", "not a repo", "--dry-run"]),
        2,
        "is not a valid hub repo id",
    ),
    (
        "eval-missing-bundle",
        lambda ws: (eval_main, ["--bundle", str(ws.root / "nope")]),
        2,
        "ws/nope: no such bundle folder",
    ),
    (
        "eval-hub-bundle-offline",
        lambda ws: (eval_main, ["--bundle", "someorg/not-cached-bundle"]),
        2,
        "not in the local hub cache",
    ),
    (
        "eval-data-empty",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("e.jsonl", "")]),
        2,
        "e.jsonl: holds no text",
    ),
    (
        "eval-data-not-utf8",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("l.txt", b"\xe9")]),
        2,
        "--data: {}/l.txt is not UTF-8 text: byte offset 0",
    ),
    (
        "eval-data-missing",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", str(ws.root / "no.jsonl")]),
        2,
        "no such file or folder",
    ),
    (
        "eval-num-sequences-zero",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--num-sequences", "0"]),
        2,
        "need --num-sequences >= 1 and --sequence-length >= 2, got 0, 512",
    ),
    (
        "eval-max-kl-nan",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--max-kl", "nan"]),
        2,
        "--max-kl must be a finite number",
    ),
    (
        "eval-device-bad",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--device", "tpu"]),
        2,
        "--device 'tpu' is not allowed",
    ),
    (
        "eval-out-is-file",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--out", ws.file("rep", "x")]),
        2,
        "rep: exists and is not a folder",
    ),
    ("eval-bundle-model-missing", lambda ws: (eval_main, ["--bundle", ws.bundle()]), 2, "golden/ouro_loopvq"),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    ("push-glob-name", lambda ws: listed(ws, "*"), 2, "files entry '*' contains a glob character"),
    ("push-bracket-name", lambda ws: listed(ws, "card[1].md"), 2, "files entry 'card[1].md' contains a glob character"),
    (
        "push-dot-slash-name",
        lambda ws: listed(ws, "./README.md"),
        2,
        "files entry './README.md' has an empty, '.' or '..' component",
    ),
    (
        "push-dotdot-name",
        lambda ws: listed(ws, "../secret.txt"),
        2,
        "files entry '../secret.txt' has an empty, '.' or '..' component",
    ),
    ("push-absolute-name", lambda ws: listed(ws, "/etc/passwd"), 2, "files entry '/etc/passwd' is an absolute path"),
    ("push-symlinked-card", symlinked_card, 2, "files entry 'README.md' is or passes through a symbolic link"),
    (
        "push-report-of-another-bundle",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(codebooks_sha256="0" * 64)),
        2,
        "the report measured another bundle named",
    ),
    (
        "manifest-entry-dotdot",
        lambda ws: manifest_entry(ws, "../../notes.txt"),
        2,
        "lists '../../notes.txt', not the name of a file inside {}/run/data",
    ),
    (
        "manifest-entry-absolute",
        lambda ws: manifest_entry(ws, "{}/notes.txt"),
        2,
        "notes.txt', an absolute path, not a file of {}/run/data",
    ),
    ("lock-is-a-symlink", linked_lock, 2, f"run/{LOCK_FILE} is a symbolic link"),
    (
        "output-holds-only-a-link",
        output_holding_a_link,
        2,
        "{}/out is not empty and is not a loopvq-calibrate run directory (no manifest.json; it holds link)",
    ),
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
    (
        "sequence-length-past-window",
        lambda ws: ws.run_with("--set", "data.sequence_length=4096"),
        2,
        "data.sequence_length: 4,096 tokens exceed the model's window of 512",
    ),
    (
        "eval-sequence-length-past-window",
        lambda ws: tiny_eval(ws, "--sequence-length", "4096"),
        2,
        "--sequence-length 4,096 exceeds the model's window of 512 tokens (max_position_embeddings in",
    ),
    (
        "model-config-bad-json",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text('{"model_type": "ouro",')),
        2,
        "{}/model/config.json is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 23)",
    ),
    (
        "model-config-not-utf8",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_bytes(b'{"x": "\xff"}')),
        2,
        "{}/model/config.json is not UTF-8 text (byte 7",
    ),
    (
        "model-no-tokenizer",
        lambda ws: model_copy(ws, lambda f: [t.unlink() for t in f.glob("tokenizer*")]),
        2,
        "{}/model has no tokenizer: none of tokenizer.json",
    ),
    (
        "model-truncated-shard",
        lambda ws: model_copy(ws, cut_shard),
        2,
        "{}/model/model.safetensors: truncated: its header says",
    ),
    (
        "model-missing-shard",
        lambda ws: model_copy(ws, lambda f: sorted(f.glob("*.safetensors"))[-1].unlink()),
        2,
        "{}/model has no weights (model.safetensors, or model.safetensors.index.json",
    ),
    (
        "model-type-of-other-weights",
        lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text((ws.huginn / "config.json").read_text())),
        2,
        "the weights in {}/model are not those of its config.json's model_type 'huginn_raven'",
    ),
    (
        "bundle-theta-negative",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(theta=-1.0)))]),
        2,
        "rope.theta must be a finite number > 0",
    ),
    (
        "bundle-rope-style-bogus",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(style="bogus")))]),
        2,
        "rope.style is 'bogus'",
    ),
    (
        "bundle-bits-inconsistent",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["bits"].update(key=0.75)))]),
        2,
        "bits.key is 0.75",
    ),
    (
        "bundle-theta-bare-nan",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": NaN')
                    )
                )
            ],
        ),
        2,
        "field rope.theta is a bare NaN, which is not JSON",
    ),
    (
        "bundle-duplicate-key",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": 10000.0, "theta": 5.0')
                    )
                )
            ],
        ),
        2,
        "field rope.theta appears more than once (duplicate JSON key)",
    ),
    (
        "bundle-card-links-out",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: ((p / "README.md").unlink(), (p / "README.md").symlink_to(ws.file("outside.md", "x")))
                )
            ],
        ),
        2,
        "{}/bundle/README.md: files entry 'README.md' is or passes through a symbolic link",
    ),
    # -- what a file can say: evaluation reports -------------------------------------------------------------
    (
        "report-two-rows-of-the-bundle",
        lambda ws: report_push(ws, lambda r: r["bundles"].append({**r["bundles"][0], "ppl_quantized": 99.0})),
        2,
        "--eval-report {}/report.json: 2 rows (bundles[0], bundles[2]) measured a bundle named 'ouro_loopvq'",
    ),
    (
        "report-row-without-ppl",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].pop("ppl_quantized")),
        2,
        "--eval-report {}/report.json: field bundles[0].ppl_quantized is missing",
    ),
    (
        "report-eval-kl-not-a-number",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].update(eval_kl="abc")),
        2,
        "{}/report.json: field bundles[0].eval_kl is 'abc', not a finite number",
    ),
    (
        "report-row-not-an-object",
        lambda ws: report_push(ws, lambda r: r["bundles"].insert(0, 5)),
        2,
        "{}/report.json: field bundles[0] is 5, not an object",
    ),
    (
        "report-serving-not-an-object",
        lambda ws: report_push(ws, lambda r: r["served"]["entries"][1].update(serving=5)),
        2,
        "{}/report.json: field served.entries[1].serving is 5, not an object or null",
    ),
    (
        "report-too-deep",
        lambda ws: report_push(ws, text=DEEP),
        2,
        "--eval-report: cannot read an evaluation report: {}/report.json: nested too deeply to read",
    ),
    (
        "report-duplicate-key",
        lambda ws: report_push(ws, text='{"bundles": [], "bundles": []}'),
        2,
        "{}/report.json: field bundles appears more than once",
    ),
    (
        "report-row-without-codebooks-sha",
        lambda ws: report_push(ws, lambda r: r["bundles"][0].pop("codebooks_sha256")),
        2,
        "the row of bundle 'ouro_loopvq' records no codebooks_sha256, so it cannot be matched to this bundle; run loopvq-eval on it again",
    ),
    (
        "push-write-card-only-without-report",
        lambda ws: (push_main, [ws.bundle(), "--write-card-only"]),
        2,
        "--write-card-only writes the card of an evaluation report: give --eval-report",
    ),
    ("push-offline-writes-no-card", offline_push, 3, "offline mode is on (HF_HUB_OFFLINE=1)"),
    # -- what a file can say: bundles ------------------------------------------------------------------------
    (
        "inspect-meta-too-deep",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP))]),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    (
        "push-meta-too-deep",
        lambda ws: (
            push_main,
            [ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP)), "--repo-id", "org/x", "--dry-run"],
        ),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    (
        "eval-meta-too-deep",
        lambda ws: (eval_main, ["--bundle", ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP))]),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    (
        "bundle-integer-too-long",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": ' + "9" * 5000)
                    )
                )
            ],
        ),
        2,
        "{}/bundle/loopvq.json: field rope.theta is an integer of 5,000 digits (999999999999...999999); at most 30 digits are read",
    ),
    ("push-overlong-name", lambda ws: listed(ws, "a" * 300), 2, "files entry 'aaaaaaaa"),
    (
        "inspect-overlong-name",
        lambda ws: (
            inspect_main,
            [ws.bundle(reseal(lambda m: m["files"].update({"a/" * 600 + "x": m["files"]["README.md"]})))],
        ),
        2,
        "is longer than a file name may be (1024 bytes, 255 a component)",
    ),
    (
        "bundle-rope-style-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(style="s" * 5_000_000)))]),
        2,
        "field rope.style is 'sssss",
    ),
    (
        "bundle-block-sites-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["blocks"][0].update(sites=list(range(1_000_000)))))]),
        2,
        "field sites [0, 1, 2, 3, 4, 5, 6, 7, ...] are not distinct sites",
    ),
    (
        "bundle-model-type-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["model"].update(model_type="m" * 1_000_000)))]),
        2,
        "field model.model_type 'mmmmm",
    ),
    (
        "push-through-a-linked-folder",
        through_linked_folder,
        2,
        "{}/bundle/docs: files entry 'docs/card.md' is or passes through a symbolic link",
    ),
    (
        "bundle-codebook-bytes-inconsistent",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m.update(codebook_bytes=m["codebook_bytes"] + 2)))]),
        2,
        "field codebook_bytes is 8194, but the blocks' codebooks hold",
    ),
    (
        "bundle-header-version-differs",
        lambda ws: (inspect_main, [ws.bundle(header_version("1.0"))]),
        2,
        "codebooks.safetensors: safetensors metadata format_version '1.0' differs from field format_version '1.1'",
    ),
    # -- what a file or a value can say: configs, models, corpora, run directories ---------------------------------
    (
        "yaml-merge-key",
        lambda ws: (calibrate_main, ["--config", ws.file("m.yaml", "quant:\n  <<: {method: cq}\n  method: loopvq\n")]),
        2,
        "quant: YAML merge keys (<<) are not allowed (<< at {}/m.yaml line 2)",
    ),
    (
        "model-path-huge",
        lambda ws: ws.run_with("--set", "model.name_or_path=org/" + "a" * 2_000_000),
        2,
        "model.name_or_path: cannot use '/",
    ),
    (
        "corpus-path-huge",
        lambda ws: ws.run_with("--set", "data.dataset=" + "d" * 2_000_000 + ".jsonl"),
        2,
        "data.dataset: cannot use '/",
    ),
    (
        "eval-data-path-huge",
        lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", "x" * 2_000_000 + ".jsonl"]),
        2,
        ".jsonl': File name too long (no file system takes a name that long)",
    ),
    ("inspect-bundle-path-huge", lambda ws: (inspect_main, ["org/" + "x" * 2_000_000]), 2, "'org/xxxx"),
    (
        "corpus-text-field-huge",
        lambda ws: ws.run_with("--set", "data.text_field=" + "t" * 2_000_000),
        2,
        "data.text_field: column 'tttt",
    ),
    (
        "model-window-not-an-integer",
        lambda ws: model_copy(ws, window("abc")),
        2,
        "{}/model/config.json: field max_position_embeddings (the model's window) must be a positive integer, got 'abc'",
    ),
    (
        "eval-model-window-negative",
        lambda ws: eval_with_window(ws, -1),
        2,
        "{}/model/config.json: field max_position_embeddings (the model's window) must be a positive integer, got -1",
    ),
    (
        "model-missing-shard-of-the-index",
        lambda ws: model_copy(ws, shards_without_the_second),
        2,
        "{}/model/model-00002-of-00002.safetensors is missing (model.safetensors.index.json names it)",
    ),
    (
        "rundir-manifest-too-deep",
        lambda ws: (ws.run_dir({"manifest.json": DEEP}), ws.run_with())[1],
        2,
        "{}/run/manifest.json is nested too deeply to read",
    ),
    (
        "manifest-entry-is-a-folder",
        manifest_folder_entry,
        2,
        "stage 'data' lists 'sub', which is a folder in {}/run/data, not a file the toolkit wrote; nothing was deleted",
    ),
]


def case_ids() -> list[str]:
    return [c.values[0] if hasattr(c, "marks") else c[0] for c in CASES]


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``root``: size and sha256 of files, '-' for folders."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) if p.is_file() else (0, "-")
    return out


@pytest.fixture
def ws(tmp_path, tiny_ouro_dir, tiny_huginn_dir, calib_corpus, monkeypatch):
    root = tmp_path / "ws"
    root.mkdir()
    monkeypatch.chdir(root)  # relative paths (--output P) land here, and are checked with the rest
    space = Workspace(root, tiny_ouro_dir, calib_corpus, tiny_huginn_dir)
    yield space
    for cleanup in space.cleanups:
        cleanup()


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len(set(case_ids())) == len(CASES)


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids())
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    main, argv = setup(ws)
    capsys.readouterr()
    before = snapshot(ws.root)
    assert main(argv) == status
    err = capsys.readouterr().err
    assert fragment.format(ws.root) in err, err[:MAX_MESSAGE]
    assert "Traceback" not in err and len(err) < MAX_MESSAGE and err.count("\n") == 1, err[:MAX_MESSAGE]
    assert snapshot(ws.root) == before  # nothing written, nothing deleted


@pytest.mark.parametrize(
    "main,module,name,argv",
    [
        (cli.inspect_main, reader, "inspect_bundle", ["b"]),
        (cli.push_main, hub, "push_bundle", ["b", "--repo-id", "org/x", "--dry-run"]),
    ],
)
def test_input_nested_deeper_than_python_recurses_is_one_line_and_exit_2(monkeypatch, capsys, main, module, name, argv):
    """Whatever reader meets it, a RecursionError that reaches a console script is bad input: exit 2, one line."""

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(module, name, too_deep)
    assert main(argv) == 2
    assert (
        capsys.readouterr().err == "error: an input is nested too deeply to read (maximum recursion depth exceeded)\n"
    )


def test_a_second_process_holding_the_lock_is_named_and_a_killed_ones_lock_is_taken_over(ws, capsys, caplog):
    """A real second run: refused at once naming its pid and host; once it is killed, its lock is taken over."""
    run = ws.run_dir()
    holder = (
        "import sys, time; from pathlib import Path; from loopvq_calib.calibration.rundir import RunDir\n"
        "r = RunDir(Path(sys.argv[1])); r.open(); print('locked', flush=True); time.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "locked"
        before = snapshot(ws.root)
        capsys.readouterr()
        assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another loopvq-calibrate run (pid {proc.pid} on host {os.uname().nodename}" in err
        assert snapshot(ws.root) == before
    finally:
        proc.kill()
        proc.wait()
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == proc.pid  # the dead run's record stays
    assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 0
    log = (run / "run.log").read_text()
    assert log.count(f"took over the lock of a run that is no longer running (pid {proc.pid}") == 1
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly: no holder recorded
    assert calibrate_main(["--config", ws.config(), "--stages", "data"]) == 0
    assert (run / "run.log").read_text().count("took over the lock") == 1  # a clean exit leaves nothing to take over


def test_user_files_beside_and_inside_a_run_directory_survive_reruns(ws):
    """Files the toolkit did not write are never deleted: beside the stages, in hidden *.tmp folders."""
    run = ws.run_dir({"notes.txt": "mine", ".backup.tmp/thesis.txt": "chapter 1", ".data.tmp/keep": "k"})
    assert calibrate_main(["--config", ws.config(), "--stages", "data", "--set", "data.seed=1"]) == 0  # reruns data
    assert (run / "notes.txt").read_text() == "mine"
    assert (run / ".backup.tmp" / "thesis.txt").read_text() == "chapter 1"
    assert (run / ".data.tmp" / "keep").read_text() == "k"
    assert not list(run.glob(".loopvq-tmp.*"))
