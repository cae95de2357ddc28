"""What a run directory's manifest may say: :func:`read_manifest` reads and checks it (valid JSON, a mapping of
stage records, each listing file names), :func:`contained` maps a listed name to a file inside its stage's
folder, and :func:`check_recorded_files` requires each listed path to be a regular file or absent, so that the
toolkit reads and deletes only files it wrote inside the run directory (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from ..config.source import shown
from ..runtime.input_files import read_capped

_START_OVER = "delete the manifest (and the stage folders) to start the run over"


class RunDirError(ValueError):
    """The run directory cannot be used (not a folder, not a run directory, unreadable manifest, user files
    where a stage's output goes, locked by another run); the message names the path."""


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` (an empty one when there is none), its stage records checked (:func:`_check_stages`)."""
    if not path.is_file():
        return {"stages": {}}
    try:
        manifest = json.loads(
            read_capped(path, "run record", error=lambda problem: RunDirError(f"{problem}; {_START_OVER}")).decode(
                "utf-8"
            )
        )
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RunDirError(f"{path} is not valid JSON ({err}); {_START_OVER}") from err
    except RecursionError:
        raise RunDirError(
            f"{path} is nested too deeply to read (no manifest the toolkit writes is); {_START_OVER}"
        ) from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise RunDirError(f"{path} cannot be read ({str(err)[:120]}); {_START_OVER}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("stages"), dict):
        raise RunDirError(f"{path} has no 'stages' mapping; {_START_OVER}")
    _check_stages(path, manifest["stages"])
    return manifest


def _check_stages(path: Path, stages: dict[str, Any]) -> None:
    """Every stage record of the manifest at ``path``: a mapping, named by one plain folder name, whose ``files``
    (sizes) and ``sha256`` are mappings of file names, each :func:`contained` in the stage's folder and a regular
    file there or absent (:func:`check_recorded_files`)."""
    for name, rec in stages.items():
        if not isinstance(rec, dict) or name in ("", ".", "..") or "/" in name:
            raise RunDirError(
                f"{path}: stage entry {shown(name)} is not a stage record (a folder name mapped to its "
                f"record); {_START_OVER}"
            )
        sizes, hashes = rec.get("files", {}), rec.get("sha256", {})
        if not (
            isinstance(sizes, dict)
            and all(type(v) is int for v in sizes.values())
            and isinstance(hashes, dict)
            and all(isinstance(v, str) for v in hashes.values())
        ):
            raise RunDirError(
                f"{path}: stage {shown(name)} has a 'files' or 'sha256' entry that is not a mapping of "
                f"file names to sizes or hashes; {_START_OVER}"
            )
        check_recorded_files(path.parent, name, {**sizes, **hashes}, source=path)  # each name once


def check_recorded_files(root: Path, stage: str, entries: Iterable[str], *, source: Path) -> list[Path]:
    """The files ``entries`` (read from ``source``) name in stage ``stage``'s folder of the run directory ``root``,
    each :func:`contained` there and a regular file or absent (never a folder, link or device, which the toolkit
    never writes), all checked before the caller touches the first; else :class:`RunDirError` naming the entry."""
    files = [(entry, contained(root, stage, entry, source=source)) for entry in entries]
    for entry, file in files:
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError:
            continue
        except OSError as err:
            raise RunDirError(
                f"{source}: stage {shown(stage)} lists {shown(entry)}, which cannot be looked up "
                f"({err.strerror}); {_START_OVER}"
            ) from None
        if not stat.S_ISREG(mode):
            what = "a folder" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else "not a file"
            raise RunDirError(
                f"{source}: stage {shown(stage)} lists {shown(entry)}, which is {what} in "
                f"{root / stage}, not a file the toolkit wrote; nothing was deleted: move it out, or "
                f"{_START_OVER}"
            )
    return [file for _, file in files]


def contained(root: Path, stage: str, entry: str, *, source: Path) -> Path:
    """The file ``entry`` (read from ``source``, a file the toolkit wrote) of stage ``stage``'s folder in the run
    directory ``root``: a relative path that stays inside that folder, also once symbolic links are followed
    (neither the folder nor a folder on the way may lead out), or :class:`RunDirError` naming ``source`` and
    the entry."""
    folder, rel = root.resolve() / stage, PurePosixPath(entry)
    if rel.is_absolute():
        why = f"an absolute path, not a file of {root / stage}"
    elif ".." in rel.parts or not rel.parts or "\0" in entry:
        why = f"not the name of a file inside {root / stage}"
    else:
        try:
            (folder / rel).resolve().relative_to(folder)
            return root / stage / rel
        except ValueError:
            why = f"a path that leads out of {root / stage} through a symbolic link"
        except (OSError, RuntimeError):  # a loop of links, a name too long
            why = "a path through a loop of symbolic links, or one the file system refuses"
    raise RunDirError(
        f"{source}: stage {shown(stage)} lists {shown(entry)}, {why}; the toolkit reads and deletes only "
        "files inside its run directory: restore the manifest, or delete it (and the stage folders) to "
        "start the run over"
    )
