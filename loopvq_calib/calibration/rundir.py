"""The run directory: one folder per stage, a manifest, fingerprinted reuse, atomic outputs.

A stage writes into ``.loopvq-tmp.<stage>`` and is renamed to ``<stage>`` only when it finished, then the
manifest (itself replaced atomically) records its fingerprint and the size and sha256 of every file it wrote
(hashed as written, ``runtime/files.py``). A rerun reuses a stage only when the recorded fingerprint equals the
new one and every recorded file is still there with its size and sha256 (a deleted, truncated or corrupted file
makes the stage run again); a stage killed midway leaves only a temporary folder, which the next run deletes.
The toolkit deletes only what it created: files the manifest records and ``.loopvq-tmp.*`` entries; every path
the manifest names must be a regular file inside its stage's folder, or absent (:mod:`.manifest`); a non-empty
folder without a manifest is never used as a run directory, and one run at a time holds the directory's lock
(docs/reliability.md).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..runtime.device_memory import PEAKS
from ..runtime.files import TMP_PREFIX, recording_digests, sha256_file, take_digests, write_json_atomic
from .manifest import RunDirError, check_recorded_files, contained, read_manifest
from .run_lock import LOCK_FILE, RunLock, RunLockError

MANIFEST = "manifest.json"  # also the marker of a run directory
LOG_FILE, CONFIG_FILE = "run.log", "config.yaml"  # written by the run into its directory, never through a link
RESUME_MARKER = ".loopvq-resume"  # in a resumable stage's temporary folder: the fingerprint its files belong to
TOOL = "loopvq-calib"
log = logging.getLogger("loopvq_calib")


_DISCARDING: dict[Path, list[threading.Thread]] = {}  # run root -> its files being deleted (RunDir.close waits)


def discard(path: Path, run_root: Path) -> None:
    """Delete the file ``path`` without waiting for the file system to free its blocks (a noticeable wait for a
    file of many GB, such as the fine-tuning stage's resume state): renamed at once to a temporary entry of the
    run directory ``run_root`` (which the next run removes if this one dies first), then unlinked in a thread
    that :meth:`RunDir.close` waits for. Nothing happens when there is no such file."""
    doomed = run_root / f"{TMP_PREFIX}discarded.{path.name}.{os.getpid()}.{threading.get_ident()}"
    try:
        os.replace(path, doomed)
    except FileNotFoundError:
        return

    def unlink() -> None:
        try:
            doomed.unlink(missing_ok=True)
        except OSError as err:  # the next run's open() removes it
            log.warning(
                "could not delete %s (%s); the next run in %s removes it", doomed, err.strerror or err, run_root
            )

    thread = threading.Thread(target=unlink, name="loopvq-discard")
    thread.start()
    _DISCARDING.setdefault(run_root, []).append(thread)


@dataclass
class StageRecord:
    """A stage's entry in the manifest. ``peak_gpu_bytes``: the most bytes torch's allocator held for tensors
    (``max_memory_allocated``) on this process's current CUDA device at any time from the stage's start to its
    end, however often the work inside it restarted the peak counters for readings of its own (fine-tuning
    does, :data:`~loopvq_calib.runtime.device_memory.PEAKS`); tensors still held from earlier stages count, their
    peaks do not; None without CUDA; the manifest holds the main process's. ``peak_rss_bytes``: the process's
    peak resident memory since it started (the operating system keeps no per-stage peak)."""

    name: str
    fingerprint: str
    status: str = "running"  # running | done | failed
    wall_s: float = 0.0
    peak_gpu_bytes: int | None = None
    peak_rss_bytes: int = 0
    reused: bool = False
    details: dict[str, Any] = field(default_factory=dict)


class RunDir:
    """A run directory on disk and its manifest (the marker that a folder is a run directory).

    Constructing one reads and checks, and changes nothing on disk; :meth:`open` creates the folder, takes
    the lock, writes the manifest and removes the toolkit's own leftover temporary folders."""

    def __init__(
        self,
        root: Path,
        is_main: bool = True,
        barrier: Callable[[], None] | None = None,
        *,
        stage_names: tuple[str, ...] = (),
    ) -> None:
        """``barrier`` synchronises processes of a distributed run (all share one temporary folder);
        ``stage_names``: the stage folders checked for files the toolkit did not write."""
        self.root = Path(root)
        self.is_main = is_main
        self.barrier = barrier or (lambda: None)
        self.lock: RunLock | None = None
        check_output_folder(self.root)
        _check_own_files(self.root)
        self.manifest: dict[str, Any] = read_manifest(self.root / MANIFEST)
        self._reusable: dict[tuple[str, str], bool] = {}  # (stage, fingerprint) -> checked while its record stands
        for name in stage_names:
            foreign = self.foreign_files(name)
            if foreign:
                raise RunDirError(
                    f"{self.path(name)} holds files this toolkit did not write ({', '.join(foreign[:3])}"
                    f"{' ...' if len(foreign) > 3 else ''}); move them out: the folder is replaced when stage "
                    f"{name} runs"
                )
        self.records: list[StageRecord] = []

    def open(self) -> None:
        """Create the folder, take the lock, write the manifest, remove this toolkit's temporary folders."""
        if self.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                _check_own_files(self.root)
                self.lock = RunLock.acquire(self.root)
            except RunLockError as err:
                raise RunDirError(str(err)) from None
            except OSError as err:
                raise RunDirError(f"output.dir: cannot use {self.root}: {err.strerror or err}") from err
            self._reload()  # as the lock holder, read it again
            self.manifest["tool"] = TOOL
            self.save()
            for stale in self.root.glob(f"{TMP_PREFIX}*"):
                if stale.is_dir() and not stale.is_symlink():
                    if not (stale / RESUME_MARKER).is_file():  # a resumable stage's partial work stays (stage())
                        shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
        self.barrier()
        if not self.is_main:
            self._reload()

    def _reload(self) -> None:
        """Read the manifest again; a stage's reuse check (:meth:`reusable`) is kept while its record is unchanged,
        so a reused stage's files are hashed once per run."""
        before = self.manifest["stages"]
        self.manifest = read_manifest(self.root / MANIFEST)
        after = self.manifest["stages"]
        self._reusable = {key: ok for key, ok in self._reusable.items() if before.get(key[0]) == after.get(key[0])}

    def close(self) -> None:
        """Wait for the files :func:`discard` deletes, then release the lock (the lock file stays: removing it
        would race with a waiting run)."""
        for thread in _DISCARDING.pop(self.root, []):
            thread.join()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def path(self, stage: str) -> Path:
        return self.root / stage

    def foreign_files(self, stage: str) -> list[str]:
        """Files under the stage's folder that the manifest does not record as written by the toolkit."""
        folder = self.path(stage)
        if not folder.is_dir() or folder.is_symlink():
            return [stage] if folder.exists() or folder.is_symlink() else []
        recorded = self.manifest["stages"].get(stage, {}).get("files", {})
        return sorted(
            str(f.relative_to(folder))
            for f in folder.rglob("*")
            if (f.is_file() or f.is_symlink()) and str(f.relative_to(folder)) not in recorded
        )

    def update(self, **entries: Any) -> None:
        """Set top-level manifest entries (config, model identity, ...) and save."""
        self.manifest.update(entries)
        self.save()

    def save(self) -> None:
        if self.is_main:
            write_json_atomic(self.root / MANIFEST, self.manifest)

    def reusable(self, stage: str, fp: str) -> bool:
        """Whether the stage's published result is reusable: done with fingerprint ``fp``, every recorded file
        there with its recorded size (all checked first) and sha256 (a record without hashes, from an older
        toolkit: sizes only); a changed file is named in a warning. Checked once while the stage's record stays
        the same."""
        if (stage, fp) not in self._reusable:
            self._reusable[stage, fp] = self._check_reusable(stage, fp)
        return self._reusable[stage, fp]

    def _check_reusable(self, stage: str, fp: str) -> bool:
        rec = self.manifest["stages"].get(stage)
        if not (rec and rec.get("status") == "done" and rec.get("fingerprint") == fp and self.path(stage).is_dir()):
            return False
        sizes, hashes = rec.get("files", {}), rec.get("sha256", {})
        files = {name: contained(self.root, stage, name, source=self.root / MANIFEST) for name in sizes}
        changed = [name for name, f in files.items() if not f.is_file() or f.stat().st_size != sizes[name]]
        if changed:
            log.warning(
                "stage %s: %s missing or changed size since the stage finished; running it again",
                stage,
                ", ".join(sorted(changed)[:5]) + (" ..." if len(changed) > 5 else ""),
            )
            return False
        corrupted = next((name for name, f in files.items() if name in hashes and sha256_file(f) != hashes[name]), None)
        if corrupted is not None:
            log.warning(
                "stage %s: %s changed since the stage finished (its sha256 differs from the manifest's); "
                "running it again",
                stage,
                files[corrupted],
            )
        return corrupted is None

    def record(self, stage: str) -> dict[str, Any]:
        return self.manifest["stages"].get(stage, {})

    def mark_reused(self, stage: str, fp: str) -> None:
        rec = StageRecord(stage, fp, status="done", reused=True)
        self.records.append(rec)
        log.info("stage %s: reusing the result in %s (fingerprint %s)", stage, self.path(stage), fp)

    def _set_status(self, name: str, fp: str, status: str) -> None:
        """A running/failed record keeps the file list of the published folder it will replace."""
        files = self.manifest["stages"].get(name, {}).get("files")
        self.manifest["stages"][name] = {"fingerprint": fp, "status": status, **({"files": files} if files else {})}
        self.save()

    @contextmanager
    def stage(self, name: str, fp: str, resumable: bool = False) -> Iterator[tuple[Path, StageRecord]]:
        """Run a stage into a temporary folder; publish it by rename only if the block succeeds.

        ``resumable``: the temporary folder of an interrupted run of this stage with the same fingerprint is
        kept (killed, failed or interrupted), so the stage can skip the work whose files are already there."""
        tmp = self.root / f"{TMP_PREFIX}{name}"
        marker = tmp / RESUME_MARKER
        if self.is_main:
            kept = resumable and marker.is_file() and marker.read_text() == fp
            if kept:
                log.info("stage %s: resuming the interrupted run's work in %s", name, tmp)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            if resumable:
                marker.write_text(fp)
            self._set_status(name, fp, "running")
        self.barrier()
        rec = StageRecord(name, fp)
        start = time.time()
        with PEAKS.stage() as peak, recording_digests(tmp):
            try:  # logged inside: once "running" is in run.log, an interrupt is recorded as the stage's failure
                log.info("stage %s: running (fingerprint %s)", name, fp)
                yield tmp, rec
            except BaseException:
                rec.status = "failed"
                if self.is_main:
                    self._set_status(name, fp, "failed")
                    if not resumable:
                        shutil.rmtree(tmp, ignore_errors=True)
                raise
        rec.wall_s = time.time() - start
        rec.peak_gpu_bytes = peak.bytes if peak is not None else None
        rec.peak_rss_bytes = _peak_rss()
        rec.status = "done"
        self.barrier()
        if self.is_main:
            final = self.path(name)
            marker.unlink(missing_ok=True)
            written = take_digests(tmp)
            try:
                self._remove_published(name)
            except RunDirError:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.replace(tmp, final)
            self.manifest["stages"][name] = {k: v for k, v in vars(rec).items() if k != "name"}
            self.manifest["stages"][name].update(_file_table(final, written))
            self.manifest["stages"][name]["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            self._reusable = {key: ok for key, ok in self._reusable.items() if key[0] != name}
            self.save()
        self.barrier()
        self.records.append(rec)
        log.info("stage %s: done in %.1f s", name, rec.wall_s)

    def _remove_published(self, name: str) -> None:
        """Delete the stage's earlier output: only the files the manifest records (every entry checked to be a
        regular file inside the folder, or absent, before the first is deleted), then the emptied folders; anything
        else found there stops the run (never deleted)."""
        final = self.path(name)
        if not final.exists() and not final.is_symlink():
            return
        foreign = self.foreign_files(name)
        if foreign:
            raise RunDirError(
                f"{final} holds files this toolkit did not write ({', '.join(foreign[:3])}); "
                "move them out and run again"
            )
        recorded = self.manifest["stages"].get(name, {}).get("files", {})
        for doomed in check_recorded_files(self.root, name, recorded, source=self.root / MANIFEST):
            doomed.unlink(missing_ok=True)
        for folder in sorted((p for p in final.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            folder.rmdir()
        final.rmdir()

    def summary_table(self) -> str:
        """Markdown-ish table of this invocation's stages."""
        rows = ["| stage | status | wall s | peak GPU GB | peak RSS GB |", "|---|---|---|---|---|"]
        for r in self.records:
            gpu = f"{r.peak_gpu_bytes / 1e9:.2f}" if r.peak_gpu_bytes is not None else "-"
            status = "reused" if r.reused else r.status
            rows.append(f"| {r.name} | {status} | {r.wall_s:.1f} | {gpu} | {r.peak_rss_bytes / 1e9:.2f} |")
        return "\n".join(rows)


def check_output_folder(root: Path) -> None:
    """Refuse a path that is a file, or a non-empty folder that is not a run directory (no manifest; the
    toolkit's own lock and temporary entries do not count, another process of this run may be creating it,
    but a symbolic link always does: the toolkit makes none)."""
    if root.exists() and not root.is_dir():
        raise RunDirError(f"output.dir: {root} exists and is not a directory")
    if root.is_dir() and not (root / MANIFEST).is_file():
        entries = sorted(
            p.name
            for p in root.iterdir()
            if p.is_symlink() or (p.name != LOCK_FILE and not p.name.startswith(TMP_PREFIX))
        )
        if entries:
            raise RunDirError(
                f"output.dir: {root} is not empty and is not a loopvq-calibrate run directory (no {MANIFEST}; it "
                f"holds {', '.join(entries[:3])}{' ...' if len(entries) > 3 else ''}); choose a new or empty folder"
            )


def _file_table(final: Path, written: dict[str, tuple[str, int]]) -> dict[str, dict[str, Any]]:
    """The manifest's ``files`` (sizes) and ``sha256`` of a published stage folder: each file's digest as logged
    when it was written; read from the file only where the log has none of its size (a file not written through
    ``runtime/files.py``: the bundle's, whose writer builds and checks the bundle in a folder of its own)."""
    sizes, hashes = {}, {}
    for f in sorted(final.rglob("*")):
        if f.is_file():
            rel, size = str(f.relative_to(final)), f.stat().st_size
            digest, logged = written.get(rel, ("", -1))
            sizes[rel], hashes[rel] = size, digest if logged == size else sha256_file(f)
    return {"files": sizes, "sha256": hashes}


def _check_own_files(root: Path) -> None:
    """The files a run writes at the top of its directory (manifest, log, config, lock) must be plain files (or
    absent), never symbolic links, so that writing them never reaches outside the directory."""
    for name in (MANIFEST, LOG_FILE, CONFIG_FILE, LOCK_FILE):
        path = root / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            what = "a symbolic link" if path.is_symlink() else "not a file"
            raise RunDirError(
                f"output.dir: {path} is {what}; the run writes this file itself, never through a link: "
                "move it away and run again"
            )


def _peak_rss() -> int:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024
