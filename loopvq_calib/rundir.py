"""The run directory: one folder per stage, a manifest, fingerprinted reuse, atomic outputs.

A stage writes into ``.<stage>.tmp`` and is renamed to ``<stage>`` only when it finished, then the
manifest (itself replaced atomically) records its fingerprint and the size of every file it wrote. A
rerun reuses a stage only when the recorded fingerprint equals the new one and every recorded file is
still there with its size (a deleted or truncated file makes the stage run again); a stage killed
midway leaves only a temporary folder, which the next run deletes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

MANIFEST = "manifest.json"
log = logging.getLogger("loopvq_calib")


def fingerprint(*parts: Any) -> str:
    """sha256 of the JSON form of ``parts`` (keys sorted)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sha256_file(path: Path | str) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


@dataclass
class StageRecord:
    name: str
    fingerprint: str
    status: str = "running"  # running | done | failed
    wall_s: float = 0.0
    peak_gpu_bytes: int | None = None
    peak_rss_bytes: int = 0
    reused: bool = False
    details: dict[str, Any] = field(default_factory=dict)


class RunDirError(ValueError):
    """The run directory cannot be used (not a folder, unreadable manifest); the message names the path."""


class RunDir:
    """A run directory on disk and its manifest."""

    def __init__(self, root: Path, is_main: bool = True, barrier: Callable[[], None] | None = None) -> None:
        """``barrier`` synchronises processes of a distributed run (all share one temporary folder)."""
        self.root = Path(root)
        self.is_main = is_main
        self.barrier = barrier or (lambda: None)
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(f"output.dir: {self.root} exists and is not a directory")
        if is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier()
        self.manifest: dict[str, Any] = _read_manifest(self.root / MANIFEST)
        self.records: list[StageRecord] = []

    def path(self, stage: str) -> Path:
        return self.root / stage

    def update(self, **entries: Any) -> None:
        """Set top-level manifest entries (config, model identity, ...) and save."""
        self.manifest.update(entries)
        self.save()

    def save(self) -> None:
        if self.is_main:
            write_json_atomic(self.root / MANIFEST, self.manifest)

    def reusable(self, stage: str, fp: str) -> bool:
        rec = self.manifest["stages"].get(stage)
        if not (rec and rec.get("status") == "done" and rec.get("fingerprint") == fp and self.path(stage).is_dir()):
            return False
        changed = [name for name, size in rec.get("files", {}).items()
                   if not (self.path(stage) / name).is_file() or (self.path(stage) / name).stat().st_size != size]
        if changed:
            log.warning("stage %s: %s missing or changed size since the stage finished; running it again",
                        stage, ", ".join(sorted(changed)[:5]) + (" ..." if len(changed) > 5 else ""))
        return not changed

    def record(self, stage: str) -> dict[str, Any]:
        return self.manifest["stages"].get(stage, {})

    def mark_reused(self, stage: str, fp: str) -> None:
        rec = StageRecord(stage, fp, status="done", reused=True)
        self.records.append(rec)
        log.info("stage %s: reusing the result in %s (fingerprint %s)", stage, self.path(stage), fp)

    @contextmanager
    def stage(self, name: str, fp: str) -> Iterator[tuple[Path, StageRecord]]:
        """Run a stage into a temporary folder; publish it by rename only if the block succeeds."""
        tmp = self.root / f".{name}.tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            self.manifest["stages"][name] = {"fingerprint": fp, "status": "running"}
            self.save()
        self.barrier()
        rec = StageRecord(name, fp)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.time()
        log.info("stage %s: running (fingerprint %s)", name, fp)
        try:
            yield tmp, rec
        except BaseException:
            rec.status = "failed"
            if self.is_main:
                self.manifest["stages"][name] = {"fingerprint": fp, "status": "failed"}
                self.save()
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        rec.wall_s = time.time() - start
        rec.peak_gpu_bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        rec.peak_rss_bytes = _peak_rss()
        rec.status = "done"
        self.barrier()
        if self.is_main:
            final = self.path(name)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self.manifest["stages"][name] = {k: v for k, v in vars(rec).items() if k != "name"}
            self.manifest["stages"][name]["files"] = {
                str(f.relative_to(final)): f.stat().st_size for f in sorted(final.rglob("*")) if f.is_file()}
            self.manifest["stages"][name]["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            self.save()
        self.barrier()
        self.records.append(rec)
        log.info("stage %s: done in %.1f s", name, rec.wall_s)

    def summary_table(self) -> str:
        """Markdown-ish table of this invocation's stages."""
        rows = ["| stage | status | wall s | peak GPU GB | peak RSS GB |", "|---|---|---|---|---|"]
        for r in self.records:
            gpu = f"{r.peak_gpu_bytes / 1e9:.2f}" if r.peak_gpu_bytes is not None else "-"
            status = "reused" if r.reused else r.status
            rows.append(f"| {r.name} | {status} | {r.wall_s:.1f} | {gpu} | {r.peak_rss_bytes / 1e9:.2f} |")
        return "\n".join(rows)


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"stages": {}}
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path} is not valid JSON ({err}); delete it (and the stage folders) to start the run over") from err
    if not isinstance(manifest, dict) or not isinstance(manifest.get("stages"), dict):
        raise RunDirError(f"{path} has no 'stages' mapping; delete it (and the stage folders) to start the run over")
    return manifest


def _peak_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


def setup_logging(root: Path, verbose: bool = True) -> None:
    """Log to ``run.log`` in the run directory and to stderr."""
    log.setLevel(logging.INFO)
    for h in list(log.handlers):
        log.removeHandler(h)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    fh = logging.FileHandler(root / "run.log")
    fh.setFormatter(fmt)
    log.addHandler(fh)
    if verbose:
        sh = logging.StreamHandler()
        sh.setFormatter(fmt)
        log.addHandler(sh)
    log.propagate = False
