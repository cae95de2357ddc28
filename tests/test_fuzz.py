"""A table of bad inputs: each must exit 2 with a message naming the key or file, write nothing and delete
nothing (docs/reliability.md). The CLI functions run in-process; a real second process is used only where
it is the point (a run holding the lock)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import ROOT, write_tiny_bundle
from support.builders import tiny_config
from support.eval_reports import eval_report, write_report

from loopvq_calib.bundle.format import meta_bytes
from loopvq_calib.calibration.rundir import LOCK_FILE, RunDir
from loopvq_calib.cli import calibrate_main, eval_main, inspect_main, push_main

GOLDEN = ROOT / "tests" / "golden" / "ouro_loopvq"
JSONL = "\n".join(json.dumps({"text": "To be, or not to be, that is the question. " * 8}) for _ in range(40)) + "\n"


@dataclass
class Workspace:
    """A folder holding the inputs of one case; everything under it is compared before and after."""

    root: Path
    model: Path
    corpus: Path
    huginn: Path  # a tiny Huginn folder (another architecture's weights)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def config(self, *overrides: str, **sections) -> str:
        """A valid tiny config (output ``run/`` here), then ``key.path=value`` edits applied to the YAML."""
        cfg = tiny_config(self.model, self.corpus, self.root / "run", **sections)
        path = self.root / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def file(self, name: str, data: bytes | str) -> str:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)

    def run_with(self, *args: str, config: str | None = None) -> tuple[Callable, list[str]]:
        return calibrate_main, ["--config", config or self.config(), *args]

    def data(self, name: str, data: bytes | str) -> tuple[Callable, list[str]]:
        return self.run_with("--set", f"data.dataset={self.file(name, data)}")

    def bundle(self, edit: Callable[[Path], None] | None = None) -> str:
        path = self.root / "bundle"
        shutil.copytree(GOLDEN, path)
        if edit is not None:
            edit(path)
        return str(path)

    def run_dir(self, user_files: dict[str, str] | None = None) -> Path:
        """A real run directory (data stage done), plus user files put into it."""
        run = self.root / "run"
        assert calibrate_main(["--config", self.config(), "--stages", "data"]) == 0
        for name, text in (user_files or {}).items():
            self.file(f"run/{name}", text)
        return run


def edit_meta(field_path: tuple, value) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        meta = json.loads((path / "loopvq.json").read_text())
        node = meta
        for key in field_path[:-1]:
            node = node[key]
        node[field_path[-1]] = value
        (path / "loopvq.json").write_text(json.dumps(meta, indent=1))
    return edit


def truncate(name: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])
    return edit


def hold_lock(ws: Workspace) -> tuple[Callable, list[str]]:
    """The run directory opened (and locked) by another RunDir of this process: flock locks are per open file."""
    ws.run_dir()
    other = RunDir(ws.root / "run")
    other.open()
    ws.cleanups.append(other.close)
    return ws.run_with("--stages", "data")


def mistyped_model_path(ws: Workspace) -> tuple[Callable, list[str]]:
    """``models/nope`` in a config beside a ``models/`` folder: a typo of a local path, not a hub id."""
    (ws.root / "models").mkdir()
    cfg = {**tiny_config(ws.model, ws.corpus, ws.root / "run"), "model": {"name_or_path": "models/nope"}}
    return ws.run_with(config=ws.file("m.yaml", yaml.safe_dump(cfg)))


def parquet_bytes() -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"body": ["no text column here"]}), sink)
    return sink.getvalue().to_pybytes()


def reseal(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Edit loopvq.json and recompute its own checksum (a writer with that bug), so the rule under test refuses it."""
    def apply(path: Path) -> None:
        meta = json.loads((path / "loopvq.json").read_text())
        edit(meta)
        (path / "loopvq.json").write_bytes(meta_bytes(meta))
    return apply


def list_file(name: str, data: bytes) -> Callable[[dict], None]:
    def edit(meta: dict) -> None:
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return edit


def listed(ws: Workspace, name: str) -> tuple[Callable, list[str]]:
    """A bundle listing ``name`` (checksums right), the folder holding a .env and every look-alike beside it."""
    def edit(path: Path) -> None:
        for extra in (".env", "card1.md", "README.md.bak"):
            (path / extra).write_text("SECRET=1")
        reseal(list_file(name, b"SECRET=1"))(path)
    return push_main, [ws.bundle(edit), "--repo-id", "org/x", "--dry-run"]


def symlinked_card(ws: Workspace) -> tuple[Callable, list[str]]:
    secret = Path(ws.file("secret.txt", "password"))
    def edit(path: Path) -> None:
        (path / "README.md").unlink()
        (path / "README.md").symlink_to(secret)
        reseal(list_file("README.md", b"password"))(path)
    return push_main, [ws.bundle(edit), "--repo-id", "org/x", "--dry-run"]


def manifest_entry(ws: Workspace, entry: str) -> tuple[Callable, list[str]]:
    """A run directory whose data record lists ``entry`` (a file outside the run), then a rerun of that stage."""
    run = ws.run_dir()
    ws.file("notes.txt", "my notes")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"]["data"]["files"][entry.format(ws.root)] = 8
    (run / "manifest.json").write_text(json.dumps(manifest))
    return ws.run_with("--set", "data.seed=1", "--stages", "data")


def linked_lock(ws: Workspace) -> tuple[Callable, list[str]]:
    run = ws.run_dir()
    (run / LOCK_FILE).unlink(missing_ok=True)
    (run / LOCK_FILE).symlink_to(ws.file("thesis.txt", "chapter 1"))
    return ws.run_with("--stages", "data")


def output_holding_a_link(ws: Workspace) -> tuple[Callable, list[str]]:
    out = ws.root / "out"
    out.mkdir()
    (out / "link").symlink_to(ws.file("mine.txt", "mine"))
    return ws.run_with("--output", str(out))


def model_copy(ws: Workspace, edit: Callable[[Path], None]) -> tuple[Callable, list[str]]:
    """A copy of the tiny model with ``edit`` applied, named by the config."""
    folder = Path(shutil.copytree(ws.model, ws.root / "model"))
    edit(folder)
    return ws.run_with("--set", f"model.name_or_path={folder}")


def cut_shard(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


def tiny_eval(ws: Workspace, *args: str) -> tuple[Callable, list[str]]:
    bundle = write_tiny_bundle(ws.root / "tb", ws.model)
    return eval_main, ["--bundle", str(bundle), "--model", str(ws.model), "--device", "cpu", *args]


def other_report(ws: Workspace) -> tuple[Callable, list[str]]:
    bundle = ws.bundle()
    report = eval_report(json.loads((Path(bundle) / "loopvq.json").read_text()))
    report["bundles"][0]["codebooks_sha256"] = "0" * 64  # the report of another bundle of that name
    path = write_report(report, ws.root / "report.json")
    return push_main, [bundle, "--repo-id", "org/x", "--dry-run", "--eval-report", str(path)]


NO_CUDA = not torch.cuda.is_available()

# (id, setup(ws) -> (main, argv), exit status, fragment of stderr)
CASES: list[tuple[str, Callable[[Workspace], tuple[Callable, list[str]]], int, str]] = [
    # -- configs and --set -------------------------------------------------------------------------
    ("set-unparsable-yaml", lambda ws: ws.run_with("--set", "quant.bits=[0.5"), 2, "quant.bits: --set value '[0.5' is not valid YAML"),
    ("set-no-equals", lambda ws: ws.run_with("--set", "quant.bits"), 2, "--set 'quant.bits': expected key.path=value"),
    ("set-empty-key-part", lambda ws: ws.run_with("--set", "quant..bits=1"), 2, "is not a key path like quant.bits"),
    ("set-unknown-key", lambda ws: ws.run_with("--set", "quant.bogus=1"), 2, "quant.bogus: unknown key"),
    ("set-section-as-value", lambda ws: ws.run_with("--set", "quant=3"), 2, "quant: expected a mapping, got int"),
    ("lr-nan", lambda ws: ws.run_with("--set", "finetune.lr=.nan"), 2, "finetune.lr: must be a finite number, got nan"),
    ("lr-string-nan", lambda ws: ws.run_with("--set", "finetune.lr=nan"), 2, "finetune.lr: must be a finite number"),
    ("tolerance-inf", lambda ws: ws.run_with("--set", "kmeans.tolerance=.inf"), 2, "kmeans.tolerance: must be a finite number, got inf"),
    ("kmeans-seed-negative", lambda ws: ws.run_with("--set", "kmeans.seed=-1"), 2, "kmeans.seed: must be in [0, 2**32), got -1"),
    ("data-seed-huge", lambda ws: ws.run_with("--set", "data.seed=4294967296"), 2, "data.seed: must be in [0, 2**32)"),
    ("finetune-seed-negative", lambda ws: ws.run_with("--set", "finetune.seed=-5"), 2, "finetune.seed: must be in [0, 2**32)"),
    ("num-sequences-float", lambda ws: ws.run_with("--set", "data.num_sequences=1e12"), 2, "data.num_sequences: expected int"),
    ("num-sequences-huge", lambda ws: ws.run_with("--set", "data.num_sequences=99999999999"), 2, "data.num_sequences: 99999999999 is out of range"),
    ("group-size-zero", lambda ws: ws.run_with("--set", "quant.group_size=0", "--set", "quant.bits=null"), 2, "quant.group_size: must be > 0"),
    ("codebook-size-3", lambda ws: ws.run_with("--set", "quant.codebook_size=3"), 2, "quant.codebook_size: must be a power of two"),
    ("sigma-min-zero", lambda ws: ws.run_with("--set", "tasq.sigma_min=0"), 2, "tasq.sigma_min: must be > 0"),
    ("weight-floor-above-1", lambda ws: ws.run_with("--set", "tasq.weight_floor=1.5"), 2, "tasq.weight_floor: is a fraction"),
    ("page-size-zero", lambda ws: ws.run_with("--set", "output.serving.page_size=0"), 2, "output.serving.page_size: must be > 0"),
    ("bundle-name-with-slash", lambda ws: ws.run_with("--set", "output.bundle_name=a/b"), 2, "output.bundle_name: 'a/b'"),
    ("config-not-utf8", lambda ws: (calibrate_main, ["--config", ws.file("latin1.yaml", b"quant:\n  method: caf\xe9\n")]), 2, "latin1.yaml is not UTF-8 text (byte 20"),
    ("config-bad-yaml", lambda ws: (calibrate_main, ["--config", ws.file("bad.yaml", "quant: [1,\n")]), 2, "bad.yaml is not valid YAML"),
    ("config-missing", lambda ws: (calibrate_main, ["--config", str(ws.root / "none.yaml")]), 2, "none.yaml does not exist"),
    ("config-is-folder", lambda ws: (calibrate_main, ["--config", str(ws.root)]), 2, "is not a file"),
    ("config-top-level-list", lambda ws: (calibrate_main, ["--config", ws.file("list.yaml", "- a\n")]), 2, "must be a mapping of sections, got list"),
    ("stages-unknown", lambda ws: ws.run_with("--stages", "data,bogus"), 2, "--stages: unknown stage(s) 'bogus'"),
    ("stages-tasq-for-loopvq", lambda ws: ws.run_with("--stages", "tasq"), 2, "tasq stage exists only for quant.method tasq"),
    ("group-size-vs-head-dim", lambda ws: ws.run_with("--set", "quant.method=cq", "--set", "quant.group_size=32", "--set", "quant.bits=null", "--set", "quant.codebook_size=256"), 2, "head_dim 16 is not divisible by group_size = 32"),
    # -- models and devices ------------------------------------------------------------------------
    ("model-relative-typo", lambda ws: mistyped_model_path(ws), 2, "model.name_or_path: no such folder:"),
    ("model-absolute-missing", lambda ws: ws.run_with("--set", f"model.name_or_path={ws.root / 'nope'}"), 2, "no such folder"),
    ("model-hub-offline", lambda ws: ws.run_with("--set", "model.name_or_path=someorg/not-cached"), 2, "is not in the local hub cache"),
    ("model-no-config-json", lambda ws: ws.run_with("--set", f"model.name_or_path={Path(ws.file('empty-model/x.txt', 'x')).parent}"), 2, "has no config.json"),
    ("model-unsupported-type", lambda ws: ws.run_with("--set", f"model.name_or_path={Path(ws.file('llama/config.json', json.dumps({'model_type': 'llama'}))).parent}"), 2, "model_type 'llama'"),
    pytest.param("model-device-cuda", lambda ws: ws.run_with("--set", "model.device=cuda"), 2, "model.device: 'cuda' asked for, but no CUDA",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")),
    ("kmeans-device-bad", lambda ws: ws.run_with("--set", "kmeans.device=gpu"), 2, "kmeans.device: 'gpu' is not allowed"),
    # -- corpora -----------------------------------------------------------------------------------
    ("corpus-empty", lambda ws: ws.data("empty.jsonl", ""), 2, "data.dataset: " + "{}/empty.jsonl holds no text"),
    ("corpus-whitespace", lambda ws: ws.data("blank.jsonl", json.dumps({"text": "   "}) + "\n"), 2, "holds no text"),
    ("corpus-jsonl-not-utf8", lambda ws: ws.data("l1.jsonl", b'{"text": "caf\xe9"}\n'), 2, "l1.jsonl is not UTF-8 text: byte offset 13"),
    ("corpus-txt-not-utf8", lambda ws: ws.data("l1.txt", b"ok\n\xff\xfe"), 2, "l1.txt is not UTF-8 text: byte offset 3"),
    ("corpus-broken-jsonl", lambda ws: ws.data("broken.jsonl", JSONL + "{not json\n"), 2, "broken.jsonl line 41 is not a JSON object"),
    ("corpus-json-array-broken", lambda ws: ws.data("broken.json", '[{"text": "a"},'), 2, "broken.json is not valid JSON"),
    ("corpus-no-text-field", lambda ws: ws.data("body.jsonl", json.dumps({"body": "x"}) + "\n"), 2, "data.text_field: column 'text' not in"),
    ("corpus-parquet-no-column", lambda ws: ws.data("p.parquet", parquet_bytes()), 2, "data.text_field: column 'text' not in"),
    ("corpus-parquet-garbage", lambda ws: ws.data("g.parquet", b"PAR1 this is not parquet"), 2, "g.parquet is not a readable parquet file"),
    ("corpus-too-small", lambda ws: ws.data("small.jsonl", json.dumps({"text": "tiny"}) + "\n"), 2, "only 0 windows of 32 tokens (data.sequence_length); 6 were asked for"),
    ("corpus-missing", lambda ws: ws.run_with("--set", f"data.dataset={ws.root / 'none.jsonl'}"), 2, "data.dataset: no local file matches"),
    ("corpus-empty-folder", lambda ws: ws.run_with("--set", f"data.dataset={Path(ws.file('corp/readme.md', '#')).parent}"), 2, "holds no .txt"),
    ("corpus-unknown-suffix", lambda ws: ws.data("notes.md", "# x"), 2, "cannot infer the file type"),
    # -- output folders, run directories, locks ----------------------------------------------------
    ("output-is-a-file", lambda ws: ws.run_with("--output", ws.file("afile", "x")), 2, "afile exists and is not a directory"),
    ("output-user-folder", lambda ws: ws.run_with("--output", str(Path(ws.file("P/data/train.csv", "x")).parents[1]), "--stages", "data"), 2, "is not empty and is not a loopvq-calibrate run directory"),
    ("output-user-tmp-folder", lambda ws: ws.run_with("--output", str(Path(ws.file("Q/.backup.tmp/thesis.txt", "x")).parents[1])), 2, "holds .backup.tmp"),
    ("output-under-a-file", lambda ws: ws.run_with("--output", ws.file("afile", "x") + "/sub"), 2, "output.dir: cannot use"),
    ("rundir-user-file-in-stage", lambda ws: (ws.run_dir({"data/mine.csv": "x"}), ws.run_with("--stages", "data"))[1], 2, "holds files this toolkit did not write (mine.csv)"),
    ("rundir-user-folder-as-stage", lambda ws: (ws.run_dir({"capture/notes.txt": "x"}), ws.run_with("--stages", "capture"))[1], 2, "run/capture holds files this toolkit did not write (notes.txt)"),
    ("rundir-bad-manifest", lambda ws: (ws.run_dir({"manifest.json": "{"}), ws.run_with())[1], 2, "manifest.json is not valid JSON"),
    ("rundir-locked", hold_lock, 2, "is in use by another loopvq-calibrate run (pid"),
    # -- bundles: inspect, push, eval --------------------------------------------------------------
    ("bundle-edited-name", lambda ws: (inspect_main, [ws.bundle(edit_meta(("name",), "other"))]), 2, "metadata checksum mismatch"),
    ("bundle-edited-config-sha", lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "config_sha256"), "0" * 64))]), 2, "metadata checksum mismatch"),
    ("bundle-edited-model-type", lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "model_type"), "llama"))]), 2, "metadata checksum mismatch"),
    ("bundle-bad-meta-sha", lambda ws: (inspect_main, [ws.bundle(edit_meta(("meta_sha256",), "xyz"))]), 2, "metadata checksum mismatch"),
    ("bundle-truncated-codebooks", lambda ws: (inspect_main, [ws.bundle(truncate("codebooks.safetensors"))]), 2, "size mismatch"),
    ("bundle-edited-card", lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "README.md").write_text("x"))]), 2, "README.md: size mismatch"),
    ("bundle-meta-not-json", lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_bytes(b"\xff"))]), 2, "loopvq.json: not valid JSON"),
    ("bundle-missing-folder", lambda ws: (inspect_main, [str(ws.root / "nope")]), 2, "nope: no such bundle folder"),
    ("bundle-hub-offline", lambda ws: (inspect_main, ["someorg/not-cached-bundle"]), 2, "not in the local hub cache"),
    ("push-edited-bundle", lambda ws: (push_main, [ws.bundle(edit_meta(("name",), "x")), "--repo-id", "org/x", "--dry-run"]), 2, "metadata checksum mismatch"),
    ("push-bad-repo-id", lambda ws: (push_main, [ws.bundle(), "--repo-id", "not a repo", "--dry-run"]), 2, "is not a valid hub repo id"),
    ("eval-missing-bundle", lambda ws: (eval_main, ["--bundle", str(ws.root / "nope")]), 2, "ws/nope: no such bundle folder"),
    ("eval-hub-bundle-offline", lambda ws: (eval_main, ["--bundle", "someorg/not-cached-bundle"]), 2, "not in the local hub cache"),
    ("eval-data-empty", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("e.jsonl", "")]), 2, "e.jsonl: holds no text"),
    ("eval-data-not-utf8", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", ws.file("l.txt", b"\xe9")]), 2, "--data: {}/l.txt is not UTF-8 text: byte offset 0"),
    ("eval-data-missing", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--data", str(ws.root / "no.jsonl")]), 2, "no such file or folder"),
    ("eval-num-sequences-zero", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--num-sequences", "0"]), 2, "need --num-sequences >= 1 and --sequence-length >= 2, got 0, 512"),
    ("eval-max-kl-nan", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--max-kl", "nan"]), 2, "--max-kl must be a finite number"),
    ("eval-device-bad", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--device", "tpu"]), 2, "--device 'tpu' is not allowed"),
    ("eval-out-is-file", lambda ws: (eval_main, ["--bundle", ws.bundle(), "--out", ws.file("rep", "x")]), 2, "rep: exists and is not a folder"),
    ("eval-bundle-model-missing", lambda ws: (eval_main, ["--bundle", ws.bundle()]), 2, "golden/ouro_loopvq"),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    ("push-glob-name", lambda ws: listed(ws, "*"), 2, "files entry '*' contains a glob character"),
    ("push-bracket-name", lambda ws: listed(ws, "card[1].md"), 2, "files entry 'card[1].md' contains a glob character"),
    ("push-dot-slash-name", lambda ws: listed(ws, "./README.md"), 2, "files entry './README.md' has an empty, '.' or '..' component"),
    ("push-dotdot-name", lambda ws: listed(ws, "../secret.txt"), 2, "files entry '../secret.txt' has an empty, '.' or '..' component"),
    ("push-absolute-name", lambda ws: listed(ws, "/etc/passwd"), 2, "files entry '/etc/passwd' is an absolute path"),
    ("push-symlinked-card", symlinked_card, 2, "files entry 'README.md' is or passes through a symbolic link"),
    ("push-report-of-another-bundle", other_report, 2, "the report measured another bundle named"),
    ("manifest-entry-dotdot", lambda ws: manifest_entry(ws, "../../notes.txt"), 2, "lists '../../notes.txt', not the name of a file inside {}/run/data"),
    ("manifest-entry-absolute", lambda ws: manifest_entry(ws, "{}/notes.txt"), 2, "notes.txt', an absolute path, not a file of {}/run/data"),
    ("lock-is-a-symlink", linked_lock, 2, f"run/{LOCK_FILE} is a symbolic link"),
    ("output-holds-only-a-link", output_holding_a_link, 2, "{}/out is not empty and is not a loopvq-calibrate run directory (no manifest.json; it holds link)"),
    ("yaml-anchor-alias", lambda ws: (calibrate_main, ["--config", ws.file("a.yaml", "quant:\n  bits: &a [0.5]\nkmeans:\n  seed: *a\n")]), 2, "quant.bits: YAML anchors and aliases are not allowed (&a at {}/a.yaml line 2)"),
    ("yaml-alias-bomb-in-set", lambda ws: ws.run_with("--set", "quant.bits=[&a0 [1, 1], &a1 [*a0, *a0], &a2 [*a1, *a1]]"), 2, "quant.bits[0]: YAML anchors and aliases are not allowed (&a0 at --set quant.bits)"),
    ("yaml-duplicate-section", lambda ws: (calibrate_main, ["--config", ws.file("d.yaml", "quant:\n  method: cq\nquant:\n  method: loopvq\n")]), 2, "quant: duplicate key ({}/d.yaml line 1 and line 3)"),
    ("yaml-duplicate-key", lambda ws: (calibrate_main, ["--config", ws.file("d.yaml", "quant:\n  method: cq\n  method: loopvq\n")]), 2, "quant.method: duplicate key ({}/d.yaml line 2 and line 3)"),
    ("yaml-too-deep", lambda ws: ws.run_with("--set", "quant.bits=" + "[" * 20_000 + "]" * 20_000), 2, "nested deeper than 32 levels (--set quant.bits)"),
    ("sequence-length-past-window", lambda ws: ws.run_with("--set", "data.sequence_length=4096"), 2, "data.sequence_length: 4,096 tokens exceed the model's window of 512"),
    ("eval-sequence-length-past-window", lambda ws: tiny_eval(ws, "--sequence-length", "4096"), 2, "--sequence-length 4,096 exceeds the model's window of 512 tokens (max_position_embeddings in"),
    ("model-config-bad-json", lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text('{"model_type": "ouro",')), 2, "{}/model/config.json is not valid JSON: Expecting property name enclosed in double quotes (line 1, column 23)"),
    ("model-config-not-utf8", lambda ws: model_copy(ws, lambda f: (f / "config.json").write_bytes(b'{"x": "\xff"}')), 2, "{}/model/config.json is not UTF-8 text (byte 7"),
    ("model-no-tokenizer", lambda ws: model_copy(ws, lambda f: [t.unlink() for t in f.glob("tokenizer*")]), 2, "{}/model has no tokenizer: none of tokenizer.json"),
    ("model-truncated-shard", lambda ws: model_copy(ws, cut_shard), 2, "{}/model/model.safetensors: truncated: its header says"),
    ("model-missing-shard", lambda ws: model_copy(ws, lambda f: sorted(f.glob("*.safetensors"))[-1].unlink()), 2, "{}/model has no weights (model.safetensors, or model.safetensors.index.json"),
    ("model-type-of-other-weights", lambda ws: model_copy(ws, lambda f: (f / "config.json").write_text((ws.huginn / "config.json").read_text())), 2, "the weights in {}/model are not those of its config.json's model_type 'huginn_raven'"),
    ("bundle-theta-negative", lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(theta=-1.0)))]), 2, "rope.theta must be a finite number > 0"),
    ("bundle-rope-style-bogus", lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(style="bogus")))]), 2, "rope.style is 'bogus'"),
    ("bundle-bits-inconsistent", lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["bits"].update(key=0.75)))]), 2, "bits.key is 0.75"),
    ("bundle-theta-bare-nan", lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_text((p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": NaN')))]), 2, "field rope.theta is a bare NaN, which is not JSON"),
    ("bundle-duplicate-key", lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_text((p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": 10000.0, "theta": 5.0')))]), 2, "field rope.theta appears more than once (duplicate JSON key)"),
    ("bundle-card-links-out", lambda ws: (inspect_main, [ws.bundle(lambda p: ((p / "README.md").unlink(), (p / "README.md").symlink_to(ws.file("outside.md", "x"))))]), 2, "{}/bundle/README.md: files entry 'README.md' is or passes through a symbolic link"),
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
    assert fragment.format(ws.root) in err, err
    assert "Traceback" not in err
    assert snapshot(ws.root) == before  # nothing written, nothing deleted


def test_a_second_process_holding_the_lock_is_named_and_a_killed_ones_lock_is_taken_over(ws, capsys, caplog):
    """A real second run: refused at once naming its pid and host; once it is killed, its lock is taken over."""
    run = ws.run_dir()
    holder = ("import sys, time; from pathlib import Path; from loopvq_calib.calibration.rundir import RunDir\n"
              "r = RunDir(Path(sys.argv[1])); r.open(); print('locked', flush=True); time.sleep(120)")
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
