"""benchmarks/calibration/code_identity.py: the identity measure_real_command.sh records, from a tree on disk and from
git."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.calibration import code_identity as ci

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    files = {
        "pyproject.toml": "[project]\n",
        "loopvq_calib/a.py": "A = 1\n",
        "configs/m.yaml": "x: 1\n",
        "scripts/run.sh": "echo\n",
        "docs/page.md": "prose\n",
        "loopvq_calib/tasks/t.jsonl": "{}\n",
        "benchmarks/bench.py": "B = 1\n",
        "benchmarks/results/r.jsonl": "{}\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return tmp_path


def test_tree_and_commit_agree_and_only_code_and_settings_count(repo):
    first = ci.tree_identity(repo)
    assert first == ci.commit_identity("HEAD", repo)
    expected = ci.identity(
        [
            ("pyproject.toml", b"[project]\n"),
            ("loopvq_calib/a.py", b"A = 1\n"),
            ("configs/m.yaml", b"x: 1\n"),
            ("scripts/run.sh", b"echo\n"),
            ("benchmarks/bench.py", b"B = 1\n"),
        ]
    )
    assert first == expected  # an independent list of the counted files gives the same digest
    (repo / "docs/page.md").write_text("other prose\n")  # prose, data and compiled files do not count
    (repo / "loopvq_calib/tasks/t.jsonl").write_text("[]\n")
    (repo / "benchmarks/results/r.jsonl").write_text("[]\n")  # stored results are data
    (repo / "loopvq_calib/__pycache__").mkdir()
    (repo / "loopvq_calib/__pycache__/a.cpython-312.pyc").write_bytes(b"\0")
    assert ci.tree_identity(repo) == first
    (repo / "loopvq_calib/a.py").write_text("A = 2\n")
    assert ci.tree_identity(repo) != first
    (repo / "loopvq_calib/a.py").write_text("A = 1\n")
    (repo / "scripts/new.py").write_text("")  # a new file counts, even before it is committed
    assert ci.tree_identity(repo) != first


def test_find_names_every_commit_with_the_identity(repo):
    one = git(repo, "rev-parse", "HEAD")
    code_one = ci.tree_identity(repo)
    (repo / "configs/m.yaml").write_text("x: 2\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "two")
    (repo / "docs/page.md").write_text("more\n")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-am", "three: prose only")
    two, three = git(repo, "rev-parse", "HEAD~1"), git(repo, "rev-parse", "HEAD")
    assert ci.find_commits(code_one, root=repo) == [one]
    assert ci.find_commits(ci.tree_identity(repo), root=repo) == [three, two]
    assert ci.find_commits(code_one, last=2, root=repo) == []
