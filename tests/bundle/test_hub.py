"""loopvq-push: the files a push sends (exactly the dry run's list, checked at the HTTP layer of huggingface_hub
against a fake hub, never the network), the refused file entries, offline mode and hub errors, and the card of an
evaluation report written after the push or instead of it (--write-card-only)."""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import _http
from support.eval_reports import eval_report, write_report

from loopvq_calib.bundle.card import EvalReportError, prepare_eval_report
from loopvq_calib.bundle.format import meta_bytes
from loopvq_calib.bundle.hub import PushError, push_bundle, upload_plan
from loopvq_calib.bundle.reader import BundleError, load_bundle
from loopvq_calib.cli import push_main

GOLDEN = ROOT / "tests" / "golden" / "ouro_loopvq"
HTTP = importlib.import_module(HfHubHTTPError.__mro__[1].__module__)  # httpx (hub 1.x) or httpx2 (hub 2.x)


class FakeHub:
    """The hub's HTTP API as huggingface_hub's client reaches it: repo creation, branches, the card's YAML check,
    preupload (every file 'regular', so its bytes travel in the commit) and commits; records every request and
    each commit's files."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict[str, Any]] = []
        self.commits: list[dict[str, Any]] = []
        self.fail: Callable[[Any], Any] | None = None  # request -> a response that replaces the normal one, or None

    def handle(self, request: Any) -> Any:
        self.requests.append((request.method, request.url.path))
        answer = self.fail(request) if self.fail is not None else None  # a failure, or None: answer normally
        if answer is not None:
            return answer
        route = request.url.path
        if route == "/api/repos/create":
            self.created.append({**json.loads(request.content), "auth": request.headers.get("authorization")})
            return HTTP.Response(200, json={"url": "https://huggingface.co/org/x"})
        if route == "/api/validate-yaml":  # hub 2.x checks a README.md's front matter before committing it
            return HTTP.Response(200, json={"errors": [], "warnings": []})
        if "/branch/" in route:
            return HTTP.Response(200, json={})
        if "/preupload/" in route:
            files = json.loads(request.content)["files"]
            return HTTP.Response(
                200,
                json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
            )
        if "/commit/" in route:
            lines = [json.loads(line) for line in request.content.decode().splitlines() if line.strip()]
            files = {
                line["value"]["path"]: base64.b64decode(line["value"]["content"])
                for line in lines
                if line["key"] == "file"
            }
            other = [line["key"] for line in lines if line["key"] not in ("header", "file")]
            self.commits.append({"route": route, "files": files, "other": other})
            return HTTP.Response(
                200,
                json={
                    "commitUrl": "https://huggingface.co/org/x/commit/" + "a" * 40,
                    "commitOid": "a" * 40,
                    "pullRequestUrl": None,
                },
            )
        return HTTP.Response(404, json={"error": f"no route {route}"})

    def writes(self) -> list[tuple[str, str]]:
        """The requests that change something on the hub (not GET, not the card's validation)."""
        return [r for r in self.requests if r[0] != "GET" and r[1] != "/api/validate-yaml"]


def failing_commit(status: int) -> Callable[[Any], Any]:
    """A ``FakeHub.fail`` that answers ``status`` to the commit and lets every other request through."""
    return lambda request: HTTP.Response(status, json={"error": "failed"}) if "/commit/" in request.url.path else None


@pytest.fixture
def fake_hub(monkeypatch):
    hub = FakeHub()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _http.set_client_factory(lambda: HTTP.Client(transport=HTTP.MockTransport(hub.handle)))
    yield hub
    _http.set_client_factory(_http.default_client_factory)


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return Path(shutil.copytree(GOLDEN, tmp_path / "bundle"))


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
        push_bundle(GOLDEN, "not a repo")
    with pytest.raises(PushError, match="namespace"):
        push_bundle(GOLDEN, "just-a-name")
    assert fake_hub.requests == []
    assert push_main([str(GOLDEN), "--repo-id", "just-a-name", "--dry-run"]) == 2  # bad input, not a failed push


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


# -- an evaluation report pushed with the bundle ----------------------------------------------------------
def _bundle_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_new_card_is_written_only_after_the_hub_took_it(bundle_dir, fake_hub, tmp_path, monkeypatch):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    attachment = prepare_eval_report(bundle_dir, report)
    before = _bundle_bytes(bundle_dir)
    listed = ["README.md", "codebooks.safetensors", "loopvq.json"]
    assert push_bundle(bundle_dir, "org/x", dry_run=True, attachment=attachment) == listed
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PushError, match="offline mode is on"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake_hub.fail = failing_commit(503)
    with pytest.raises(PushError, match="HTTP 503"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    assert _bundle_bytes(bundle_dir) == before  # a dry run, an offline push and a failed commit write nothing
    fake_hub.fail = None
    assert push_bundle(bundle_dir, "org/x", attachment=attachment) == listed
    sent = fake_hub.commits[-1]["files"]
    assert sent["README.md"] == attachment.card and sent["loopvq.json"] == attachment.meta
    assert sent["codebooks.safetensors"] == before["codebooks.safetensors"]
    assert _bundle_bytes(bundle_dir) == sent  # the folder now holds what the hub holds
    assert "## Evaluation" in load_bundle(bundle_dir).path.joinpath("README.md").read_text()
    requests = len(fake_hub.requests)
    with pytest.raises(EvalReportError, match=r"loopvq\.json: changed since the evaluation report was prepared"):
        push_bundle(bundle_dir, "org/x", attachment=attachment)  # prepared against the old loopvq.json
    assert len(fake_hub.requests) == requests


def fail_meta_rename(monkeypatch) -> None:
    """Make the rename of a new loopvq.json into place fail (EIO); every other rename works."""
    real_replace = os.replace

    def replace(src, dst):
        if Path(dst).name == "loopvq.json":
            raise OSError(errno.EIO, "Input/output error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)


def test_a_failed_local_write_after_the_push_is_a_push_error_and_keeps_the_old_pair(
    bundle_dir, fake_hub, tmp_path, monkeypatch
):
    attachment = prepare_eval_report(
        bundle_dir, write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    )
    before = _bundle_bytes(bundle_dir)
    fail_meta_rename(monkeypatch)
    with pytest.raises(
        PushError,
        match=r"pushed .* to org/x, but writing the new README\.md and loopvq\.json into "
        r"the folder failed \(\[Errno 5\] Input/output error\)",
    ):
        push_bundle(bundle_dir, "org/x", attachment=attachment)
    monkeypatch.undo()
    assert len(fake_hub.commits) == 1 and _bundle_bytes(bundle_dir) == before


def test_loopvq_push_writes_the_card_only_after_the_push(bundle_dir, fake_hub, tmp_path, monkeypatch, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    before = _bundle_bytes(bundle_dir)
    argv = [str(bundle_dir), "--repo-id", "org/x", "--eval-report", str(report)]
    assert push_main(argv + ["--dry-run"]) == 0 and "would add 4 evaluation results" in capsys.readouterr().out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert push_main(argv) == 3 and "offline mode is on" in capsys.readouterr().err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    fake_hub.fail = failing_commit(500)
    assert push_main(argv) == 3 and "HTTP 500" in capsys.readouterr().err
    assert _bundle_bytes(bundle_dir) == before and fake_hub.commits == []  # nothing written by a failed push
    fake_hub.fail = None
    assert push_main(argv) == 0 and "added 4 evaluation results" in capsys.readouterr().out
    assert _bundle_bytes(bundle_dir) == fake_hub.commits[-1]["files"] != before
    other = write_report(eval_report({**load_bundle(bundle_dir).meta, "method": "cq"}), tmp_path / "other.json")
    assert push_main([str(bundle_dir), "--repo-id", "org/x", "--eval-report", str(other)]) == 2
    assert "measured another bundle" in capsys.readouterr().err and len(fake_hub.commits) == 1


def test_write_card_only_writes_what_a_push_would_and_sends_nothing(bundle_dir, fake_hub, tmp_path, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    attachment = prepare_eval_report(bundle_dir, report)
    before = _bundle_bytes(bundle_dir)
    argv = [str(bundle_dir), "--eval-report", str(report), "--write-card-only"]
    assert push_main(argv + ["--dry-run"]) == 0 and _bundle_bytes(bundle_dir) == before
    card = bundle_dir / "README.md"
    assert capsys.readouterr().out == f"would write 4 evaluation results into {card} (nothing pushed)\n"
    assert push_main(argv) == 0
    assert capsys.readouterr().out == (
        f"wrote 4 evaluation results into {card} and its checksum into loopvq.json (nothing pushed)\n"
    )
    assert _bundle_bytes(bundle_dir) == {**before, "README.md": attachment.card, "loopvq.json": attachment.meta}
    assert "## Evaluation" in (bundle_dir / "README.md").read_text() and load_bundle(bundle_dir)
    assert fake_hub.requests == []
    assert push_main([str(bundle_dir), "--write-card-only"]) == 2
    assert "--write-card-only writes the card of an evaluation report" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a push still needs its repo
        push_main([str(bundle_dir), "--dry-run"])
    assert stop.value.code == 2 and "the following arguments are required: --repo-id" in capsys.readouterr().err


def test_write_card_only_failing_keeps_the_old_pair_and_exits_3(bundle_dir, tmp_path, monkeypatch, capsys):
    report = write_report(eval_report(load_bundle(bundle_dir).meta), tmp_path / "report.json")
    before = _bundle_bytes(bundle_dir)
    fail_meta_rename(monkeypatch)
    assert push_main([str(bundle_dir), "--eval-report", str(report), "--write-card-only"]) == 3
    assert capsys.readouterr().err == (
        f"error: writing the new README.md and loopvq.json into {bundle_dir} failed "
        "(Input/output error); the folder keeps its old pair\n"
    )
    monkeypatch.undo()
    assert _bundle_bytes(bundle_dir) == before


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
