"""loopvq-push: the files a push sends (exactly the dry run's list, checked at the HTTP layer of huggingface_hub
against a fake hub, support/fake_hub.py, never the network), the refused file entries, offline mode and hub
errors. The card of an evaluation report written after the push or instead of it (--write-card-only):
test_hub_card.py."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from support.fake_hub import (
    HTTP,
    failing_commit,
    fake_hub,  # noqa: F401 (the fixture)
)
from support.golden import (
    GOLDEN_BUNDLE,
    bundle_dir,  # noqa: F401 (the fixture)
)

from loopvq_calib.bundle.format import meta_bytes
from loopvq_calib.bundle.hub import PushError, push_bundle, upload_plan
from loopvq_calib.bundle.reader import BundleError
from loopvq_calib.cli import push_main


def relist(folder: Path, names: list[str]) -> None:
    """Rewrite loopvq.json so that ``files`` lists ``names`` (each an existing file, its checksum recomputed)
    besides the bundle's own, resealed: only the naming and containment rules can refuse it."""
    meta = json.loads((folder / "loopvq.json").read_text())
    for name in names:
        data = (folder / name).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "loopvq.json").write_bytes(meta_bytes(meta))


def test_the_commit_sends_exactly_the_dry_run_list_and_nothing_beside_it(bundle_dir, fake_hub, capsys):
    """Secrets, a git checkout, notes and a look-alike of a listed file beside the bundle never leave the machine;
    the commit carries the listed files byte for byte."""
    (bundle_dir / ".env").write_text("HF_TOKEN=hf_secret\n")
    (bundle_dir / ".git").mkdir()
    (bundle_dir / ".git" / "config").write_text("[remote]\n")
    (bundle_dir / "notes.txt").write_text("draft")
    (bundle_dir / "extra").mkdir()
    (bundle_dir / "extra" / "card1.md").write_text("listed")
    (bundle_dir / "extra" / "card2.md").write_text("not listed")
    relist(bundle_dir, ["extra/card1.md"])
    listed = ["README.md", "codebooks.safetensors", "extra/card1.md", "loopvq.json"]
    assert push_bundle(bundle_dir, "org/tiny-loopvq", dry_run=True) == listed
    assert fake_hub.requests == []  # a dry run sends nothing
    assert push_main([str(bundle_dir), "--repo-id", "org/tiny-loopvq", "--dry-run"]) == 0
    assert capsys.readouterr().out.split("\n")[1:] == [f"  {name}" for name in listed] + [""]
    assert push_bundle(bundle_dir, "org/tiny-loopvq") == listed
    (commit,) = fake_hub.commits
    assert commit["files"] == {name: (bundle_dir / name).read_bytes() for name in listed}
    assert commit["other"] == []  # no deletions, copies or LFS pointers


def test_push_creates_the_repo_and_the_branch_then_commits_once(bundle_dir, fake_hub):
    files = push_bundle(bundle_dir, "org/tiny-loopvq", private=True, token="hf_x", revision="v1")
    assert fake_hub.writes() == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/models/org/tiny-loopvq/branch/v1"),
        ("POST", "/api/models/org/tiny-loopvq/preupload/v1"),
        ("POST", "/api/models/org/tiny-loopvq/commit/v1"),
    ]
    (created,) = fake_hub.created
    assert created["name"] == "tiny-loopvq" and created["auth"] == "Bearer hf_x"
    assert created.get("private") is True or created.get("visibility") == "private"  # hub 1.x / 2.x
    assert sorted(fake_hub.commits[0]["files"]) == files == upload_plan_names(bundle_dir)


def upload_plan_names(folder: Path) -> list[str]:
    return [u.name for u in upload_plan(folder)]


def _symlinked_card(folder: Path) -> str:
    outside = folder.parent / "passwd"
    outside.write_text("root:x:0:0\n")
    (folder / "README.md").unlink()
    (folder / "README.md").symlink_to(outside)
    relist(folder, ["README.md"])
    return "README.md"


def _through_symlinked_folder(folder: Path) -> str:
    outside = folder.parent / "elsewhere"
    outside.mkdir()
    (outside / "card.md").write_text("outside")
    (folder / "docs").symlink_to(outside, target_is_directory=True)
    relist(folder, ["docs/card.md"])
    return "docs/card.md"


def _listed(name: str, beside: str | None = None) -> Callable[[Path], str]:
    def edit(folder: Path) -> str:
        (folder / name.lstrip("./")).write_text("listed")
        if beside:
            (folder / beside).write_text("a look-alike the name matches as a glob")
        meta = json.loads((folder / "loopvq.json").read_text())
        data = (folder / name.lstrip("./")).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (folder / "loopvq.json").write_bytes(meta_bytes(meta))
        return name

    return edit


def _folder_entry(folder: Path) -> str:
    (folder / "sub").mkdir()
    meta = json.loads((folder / "loopvq.json").read_text())
    meta["files"]["sub"] = {"sha256": "0" * 64, "bytes": 0}
    (folder / "loopvq.json").write_bytes(meta_bytes(meta))
    return "sub"


@pytest.mark.parametrize(
    "edit,message",
    [
        (_listed("*"), r"files entry '\*' contains a glob character"),
        (_listed("card[1].md", beside="card1.md"), r"files entry 'card\[1\]\.md' contains a glob character"),
        (_listed("./notes.md"), r"files entry '\./notes\.md' has an empty, '\.' or '\.\.' component"),
        (_listed("a\\b.md"), r"files entry 'a\\\\b\.md' contains a backslash"),
        (_symlinked_card, r"README\.md: files entry 'README\.md' is or passes through a symbolic link"),
        (_through_symlinked_folder, r"docs: files entry 'docs/card\.md' is or passes through a symbolic link"),
        (_folder_entry, r"sub: files entry 'sub' is not a regular file"),
    ],
)
def test_refused_entries_stop_the_push_before_anything_is_sent(bundle_dir, fake_hub, capsys, edit, message):
    name = edit(bundle_dir)
    for dry_run in (True, False):
        with pytest.raises(BundleError, match=message):
            push_bundle(bundle_dir, "org/x", dry_run=dry_run)
    assert fake_hub.requests == []
    assert push_main([str(bundle_dir), "--repo-id", "org/x"]) == 2  # bad input, nothing sent
    assert repr(name) in capsys.readouterr().err and fake_hub.requests == []


@pytest.mark.parametrize(
    "name,message", [("../outside.md", "has an empty, '.' or '..' component"), ("/etc/passwd", "is an absolute path")]
)
def test_entries_pointing_outside_the_folder_are_refused(bundle_dir, fake_hub, name, message):
    meta = json.loads((bundle_dir / "loopvq.json").read_text())
    meta["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (bundle_dir / "loopvq.json").write_bytes(meta_bytes(meta))
    with pytest.raises(BundleError, match=f"files entry {name!r} {message}"):
        push_bundle(bundle_dir, "org/x")
    assert fake_hub.requests == []


def test_a_symlinked_loopvq_json_is_refused(bundle_dir, fake_hub):
    real = bundle_dir.parent / "loopvq.json"
    shutil.move(bundle_dir / "loopvq.json", real)
    (bundle_dir / "loopvq.json").symlink_to(real)
    with pytest.raises(BundleError, match=r"loopvq\.json: files entry 'loopvq\.json' is or passes through a symbolic"):
        push_bundle(bundle_dir, "org/x")
    assert fake_hub.requests == []


def test_invalid_bundle_or_repo_id_fails_before_any_upload(bundle_dir, fake_hub):
    (bundle_dir / "README.md").write_text("edited by hand")
    with pytest.raises(BundleError, match="README.md"):
        push_bundle(bundle_dir, "org/name")
    with pytest.raises(PushError, match="ORG/NAME"):
        push_bundle(GOLDEN_BUNDLE, "not a repo")
    with pytest.raises(PushError, match="namespace"):
        push_bundle(GOLDEN_BUNDLE, "just-a-name")
    assert fake_hub.requests == []
    assert push_main([str(GOLDEN_BUNDLE), "--repo-id", "just-a-name", "--dry-run"]) == 2  # bad input, not a failed push


def test_offline_push_fails_at_once_with_a_clear_message(bundle_dir, fake_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PushError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
        push_bundle(bundle_dir, "org/tiny-loopvq")
    assert fake_hub.requests == []
    assert push_main([str(bundle_dir), "--repo-id", "org/tiny-loopvq"]) == 3


def test_network_and_auth_errors_become_push_errors(bundle_dir, fake_hub):
    def unreachable(request):
        raise HTTP.ConnectError("Name or service not known", request=request)

    fake_hub.fail = unreachable
    with pytest.raises(PushError, match="could not reach the Hugging Face Hub.*Name or service not known"):
        push_bundle(bundle_dir, "org/x")
    fake_hub.fail = lambda request: HTTP.Response(401, json={"error": "Invalid credentials"})
    with pytest.raises(PushError, match=r"not authorised \(HTTP 401\).*HF_TOKEN.*write to org"):
        push_bundle(bundle_dir, "org/x")
    fake_hub.fail = failing_commit(500)
    with pytest.raises(PushError, match=r"the hub answered HTTP 500"):
        push_bundle(bundle_dir, "org/x")
    assert fake_hub.commits == [] and ("POST", "/api/models/org/x/commit/main") in fake_hub.requests


def test_an_entry_the_file_system_cannot_look_up_is_named(bundle_dir, fake_hub, monkeypatch, capsys):
    real_lstat = Path.lstat

    def lstat(self):
        if self.name == "README.md":
            raise OSError(errno.ENAMETOOLONG, "File name too long")
        return real_lstat(self)

    monkeypatch.setattr(Path, "lstat", lstat)
    message = f"{bundle_dir / 'loopvq.json'}: files entry 'README.md' cannot be looked up (File name too long)"
    with pytest.raises(BundleError, match=re.escape(message)):
        upload_plan(bundle_dir)
    assert push_main([str(bundle_dir), "--repo-id", "org/x", "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n" and fake_hub.requests == []
