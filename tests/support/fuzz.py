"""The machinery of the fuzz table (tests/test_fuzz.py and its topic files tests/test_fuzz_*.py): a workspace
folder per case (the ``ws`` fixture), the check every case passes, and the builders of its bad inputs (bundles,
run directories, model folders, evaluation reports), each returning the CLI function and its arguments."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT, write_tiny_bundle
from safetensors.torch import load_file, save_file

from loopvq_calib.bundle.format import meta_bytes
from loopvq_calib.calibration.rundir import LOCK_FILE, RunDir
from loopvq_calib.cli import calibrate_main, eval_main, push_main
from support.builders import tiny_config
from support.eval_reports import eval_report, write_report

Setup = Callable[["Workspace"], tuple[Callable, list[str]]]
Case = tuple[str, Setup, int, str]  # (id, setup(ws) -> (main, argv), exit status, fragment of stderr)

MAX_MESSAGE = 2_000  # characters on stderr: no message shows an unbounded value

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


@pytest.fixture
def ws(
    tmp_path: Path, tiny_ouro_dir: Path, tiny_huginn_dir: Path, calib_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Workspace]:
    """The case's workspace, also its working directory; its cleanups run after the case."""
    root = tmp_path / "ws"
    root.mkdir()
    monkeypatch.chdir(root)  # relative paths (--output P) land here, and are checked with the rest
    space = Workspace(root, tiny_ouro_dir, calib_corpus, tiny_huginn_dir)
    yield space
    for cleanup in space.cleanups:
        cleanup()


def case_ids(cases: list) -> list[str]:
    """The ids of a table's cases, plain or wrapped in ``pytest.param``."""
    return [c.values[0] if hasattr(c, "marks") else c[0] for c in cases]


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``root``: size and sha256 of files, '-' for folders."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) if p.is_file() else (0, "-")
    return out


def assert_refused(ws: Workspace, capsys: pytest.CaptureFixture[str], setup: Setup, status: int, fragment: str) -> None:
    """One case of the table: its CLI call exits ``status`` with one short line on stderr holding ``fragment``
    (``{}``: the workspace) and no traceback, and writes and deletes nothing in the workspace."""
    main, argv = setup(ws)
    capsys.readouterr()
    before = snapshot(ws.root)
    assert main(argv) == status
    err = capsys.readouterr().err
    assert fragment.format(ws.root) in err, err[:MAX_MESSAGE]
    assert "Traceback" not in err and len(err) < MAX_MESSAGE and err.count("\n") == 1, err[:MAX_MESSAGE]
    assert snapshot(ws.root) == before  # nothing written, nothing deleted


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


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested deeper than Python recurses


def report_push(
    ws: Workspace,
    edit: Callable[[dict], object] | None = None,
    *,
    text: str | None = None,
    args: tuple[str, ...] = ("--dry-run",),
) -> tuple[Callable, list[str]]:
    """loopvq-push of the golden bundle with a report of it (support/eval_reports.py), ``edit``ed, or its text
    replaced by ``text``."""
    bundle = ws.bundle()
    report = eval_report(json.loads((Path(bundle) / "loopvq.json").read_text()))
    if edit is not None:
        edit(report)
    path = write_report(report, ws.root / "report.json")
    if text is not None:
        path.write_text(text)
    return push_main, [bundle, "--repo-id", "org/x", *args, "--eval-report", str(path)]


def offline_push(ws: Workspace) -> tuple[Callable, list[str]]:
    """A real push (no --dry-run) with a report, under HF_HUB_OFFLINE=1 (restored after the case)."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    ws.cleanups.append(
        lambda: os.environ.pop("HF_HUB_OFFLINE") if previous is None else os.environ.update(HF_HUB_OFFLINE=previous)
    )
    return report_push(ws, args=())


def through_linked_folder(ws: Workspace) -> tuple[Callable, list[str]]:
    """A bundle listing docs/card.md, its docs/ a symbolic link to a folder outside."""
    outside = Path(ws.file("elsewhere/card.md", "outside")).parent

    def edit(path: Path) -> None:
        (path / "docs").symlink_to(outside, target_is_directory=True)
        reseal(list_file("docs/card.md", b"outside"))(path)

    return push_main, [ws.bundle(edit), "--repo-id", "org/x", "--dry-run"]


def header_version(version: str) -> Callable[[Path], None]:
    """codebooks.safetensors rewritten with ``version`` in its header metadata, its checksum resealed."""

    def edit(path: Path) -> None:
        file = path / "codebooks.safetensors"
        save_file(load_file(file), str(file), metadata={"format": "loopvq", "format_version": version})
        reseal(list_file("codebooks.safetensors", file.read_bytes()))(path)

    return edit


def window(value: object) -> Callable[[Path], None]:
    """config.json's max_position_embeddings (the tiny Ouro's window) set to ``value``."""

    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["max_position_embeddings"] = value
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def eval_with_window(ws: Workspace, value: object) -> tuple[Callable, list[str]]:
    """loopvq-eval of a tiny bundle on a copy of the model whose window is ``value``."""
    folder = Path(shutil.copytree(ws.model, ws.root / "model"))
    window(value)(folder)
    bundle = write_tiny_bundle(ws.root / "tb", ws.model)
    return eval_main, ["--bundle", str(bundle), "--model", str(folder), "--device", "cpu"]


def shards_without_the_second(folder: Path) -> None:
    """The weights split into two shards named by model.safetensors.index.json, then the second shard deleted."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").unlink()


def manifest_folder_entry(ws: Workspace) -> tuple[Callable, list[str]]:
    """A data record listing 'sub', an empty folder inside run/data, first (before the stage's own files)."""
    run = ws.run_dir()
    (run / "data" / "sub").mkdir()
    manifest = json.loads((run / "manifest.json").read_text())
    record = manifest["stages"]["data"]
    record["files"] = {"sub": 8, **record["files"]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return ws.run_with("--set", "data.seed=1", "--stages", "data")
