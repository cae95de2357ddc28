"""The identity of the code a measurement ran, a SHA-256 over the paths and contents of the files that make up the
toolkit and its measurements (``pyproject.toml`` and the code and settings under ``loopvq_calib/``, ``configs/``,
``scripts/`` and ``benchmarks/``; not the stored results). `benchmarks/calibration/measure_real_command.sh` records it
in every results line, because the device machine's copy of the tree has no history to ask; ``--find`` names the
commits of this repository with that identity.

    python benchmarks/calibration/code_identity.py                    # the working tree's
    python benchmarks/calibration/code_identity.py --commit HEAD      # a commit's
    python benchmarks/calibration/code_identity.py --find 1f2e... [--last 300]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.* and an uninstalled loopvq_calib

from benchmarks.common.paths import ROOT

FOLDERS = ("loopvq_calib", "configs", "scripts", "benchmarks")
FILES = ("pyproject.toml",)
SUFFIXES = (".py", ".yaml", ".sh", ".cu", ".cuh", ".toml")


def counts(path: str) -> bool:
    """Whether a repository-relative POSIX path is part of the identity."""
    return path in FILES or (path.split("/", 1)[0] in FOLDERS and path.endswith(SUFFIXES))


def identity(files: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 over (path, SHA-256 of contents) of the counted files, in path order."""
    digest = hashlib.sha256()
    for path, data in sorted((p, d) for p, d in files if counts(p)):
        digest.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


def tree_identity(root: Path = ROOT) -> str:
    """The identity of the files as they are on disk under ``root`` (what a run there imports)."""
    paths = [root / name for name in FILES if (root / name).is_file()]
    paths += [p for folder in FOLDERS if (root / folder).is_dir() for p in (root / folder).rglob("*") if p.is_file()]
    names = [(p, p.relative_to(root).as_posix()) for p in paths]
    return identity((name, p.read_bytes()) for p, name in names if counts(name))


def _git(root: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(root), *args], input=data, capture_output=True, check=True).stdout


def commit_identity(commit: str, root: Path = ROOT) -> str:
    """The identity of the counted files of ``commit``, read from git."""
    listing = _git(root, "ls-tree", "-r", "-z", commit, "--", *FOLDERS, *FILES).split(b"\0")
    entries = [line.split(b"\t", 1) for line in listing if line]
    objects = [(meta.split()[2].decode(), path.decode()) for meta, path in entries if counts(path.decode())]
    batch = _git(root, "cat-file", "--batch", data="".join(f"{sha}\n" for sha, _ in objects).encode())
    files, at = [], 0
    for _, path in objects:  # each object: "<sha> blob <size>\n<contents>\n"
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        files.append((path, batch[header_end + 1 : header_end + 1 + size]))
        at = header_end + 2 + size
    return identity(files)


def find_commits(code: str, last: int = 300, root: Path = ROOT) -> list[str]:
    """The commits among the ``last`` of HEAD's history whose identity is ``code``, newest first."""
    commits = _git(root, "rev-list", f"--max-count={last}", "HEAD").decode().split()
    return [c for c in commits if commit_identity(c, root) == code]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", help="the identity of this commit instead of the working tree's")
    ap.add_argument("--find", metavar="HASH", help="print the commits with this identity")
    ap.add_argument("--last", type=int, default=300, help="how far back --find looks (commits)")
    args = ap.parse_args()
    if args.find:
        found = find_commits(args.find, args.last)
        print("\n".join(found) if found else f"no commit among the last {args.last} has identity {args.find}")
        raise SystemExit(0 if found else 1)
    print(commit_identity(args.commit) if args.commit else tree_identity())


if __name__ == "__main__":
    main()
