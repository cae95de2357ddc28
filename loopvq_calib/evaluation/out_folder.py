"""``loopvq-eval --out``: the report folder, under the rules of ``loopvq-calibrate --output`` (docs/reliability.md,
"Your files"). Its files are written through a temporary sibling and a rename, so never through a symbolic link,
and a file is replaced only when loopvq-eval wrote it: the folder's ``.loopvq-eval.json`` records the sha256 of
every file written there, and a report file in the folder that is a link, is not recorded or was edited since is
refused before any work. Other files in the folder are never touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..runtime.files import sha256_file, write_bytes_atomic
from ..runtime.input_files import long_number, parse_json, read_capped

OUT_RECORD = ".loopvq-eval.json"  # name -> sha256 of each report file loopvq-eval wrote into the folder
REPORT_FILES = (
    "report.json",
    "report.md",
    "kl_by_method.png",
    "kl_per_step.png",
    "nmse_per_step.png",
    "finetune_curve.png",
    "served_accuracy.png",
    "accuracy_vs_bytes.png",
)


class OutFolderError(ValueError):
    """``--out`` names a folder loopvq-eval may not write its report into; ``loopvq-eval`` exits 2."""


def check_out_folder(out_dir: str | Path | None) -> None:
    """The report folder does not exist yet, or is a folder whose report files (REPORT_FILES) are each absent or
    a regular file loopvq-eval wrote there, unchanged since (its record, :data:`OUT_RECORD`)."""
    if out_dir is None:
        return
    folder = Path(out_dir)
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise OutFolderError(f"--out {out_dir}: exists and is not a folder")
    record = _record(folder)
    for name in REPORT_FILES:
        _check_replaceable(folder, name, record)


def _check_replaceable(folder: Path, name: str, record: dict[str, str]) -> None:
    file = folder / name
    if not os.path.lexists(file):
        return
    if file.is_symlink():
        raise OutFolderError(
            f"--out {folder}: {name} is a symbolic link; loopvq-eval never writes through a link "
            "(remove it or choose another --out)"
        )
    if not file.is_file():
        raise OutFolderError(
            f"--out {folder}: {name} is not a regular file; loopvq-eval replaces only the report "
            "files it wrote (move it or choose another --out)"
        )
    if record.get(name) != sha256_file(file):
        raise OutFolderError(
            f"--out {folder}: {name} was not written by loopvq-eval, or was edited since (not as "
            f"{OUT_RECORD} records it); loopvq-eval replaces only the report files it wrote (move it "
            "or choose another --out)"
        )


def write_out_files(folder: Path, files: dict[str, bytes]) -> list[Path]:
    """Write ``files`` (REPORT_FILES names -> bytes) into ``folder``, checked again first
    (:func:`check_out_folder`), each renamed into place, then their digests into the folder's record;
    returns the written paths."""
    unknown = sorted(set(files) - set(REPORT_FILES))
    if unknown:
        raise ValueError(f"not a report file of loopvq-eval: {', '.join(unknown)}")
    check_out_folder(folder)
    folder.mkdir(parents=True, exist_ok=True)
    record = _record(folder)
    written = []
    for name, data in files.items():
        record[name] = write_bytes_atomic(folder / name, data)
        written.append(folder / name)
    write_bytes_atomic(folder / OUT_RECORD, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode())
    return written


def _record(folder: Path) -> dict[str, str]:
    """The folder's record of what loopvq-eval wrote (empty when there is none or it is not one)."""
    if not os.path.lexists(folder / OUT_RECORD) or (folder / OUT_RECORD).is_symlink():
        return {}
    try:
        record = parse_json(read_capped(folder / OUT_RECORD, "run record", error=OutFolderError))
    except (OutFolderError, ValueError, RecursionError):
        return {}
    if not isinstance(record, dict) or long_number(record) is not None:
        return {}
    return {str(k): v for k, v in record.items() if k in REPORT_FILES and isinstance(v, str)}
