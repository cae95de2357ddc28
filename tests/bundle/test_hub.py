"""loopvq-push logic: dry runs, offline mode, and the hub calls (against a fake HfApi, never the network)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import ROOT
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

from loopvq_calib.bundle import hub
from loopvq_calib.bundle.hub import PushError, push_bundle
from loopvq_calib.bundle.reader import BundleError
from loopvq_calib.cli import push_main

GOLDEN = ROOT / "tests" / "golden" / "ouro_loopvq"


@pytest.fixture
def bundle_dir(tmp_path) -> Path:
    return Path(shutil.copytree(GOLDEN, tmp_path / "bundle"))


class FakeApi:
    calls: list[tuple] = []
    fail: Exception | None = None

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        if self.fail is not None:
            raise self.fail

    def create_branch(self, repo_id, branch, exist_ok=False):
        self.calls.append(("create_branch", repo_id, branch, exist_ok))

    def upload_folder(self, folder_path, repo_id, revision=None, allow_patterns=None, commit_message=None):
        self.calls.append(("upload_folder", folder_path, repo_id, revision, allow_patterns))


@pytest.fixture
def fake_api(monkeypatch):
    FakeApi.calls, FakeApi.fail = [], None
    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return FakeApi


def test_dry_run_lists_exactly_the_bundle_files(bundle_dir, monkeypatch):
    monkeypatch.setattr(hub, "HfApi", None)  # any hub call would fail
    files = push_bundle(bundle_dir, "org/tiny-loopvq", dry_run=True)
    assert files == ["README.md", "codebooks.safetensors", "loopvq.json"]
    assert files == sorted(p.name for p in bundle_dir.iterdir())


def test_only_the_files_the_format_lists_are_uploaded(bundle_dir, fake_api, capsys):
    """Secrets, a git checkout and notes beside the bundle files never leave the machine."""
    (bundle_dir / ".env").write_text("HF_TOKEN=hf_secret\n")
    (bundle_dir / ".git").mkdir()
    (bundle_dir / ".git" / "config").write_text("[remote]\n")
    (bundle_dir / "notes.txt").write_text("draft")
    listed = sorted({"loopvq.json", *json.loads((bundle_dir / "loopvq.json").read_text())["files"]})
    assert listed == ["README.md", "codebooks.safetensors", "loopvq.json"]
    assert push_bundle(bundle_dir, "org/tiny-loopvq", dry_run=True) == listed
    assert push_main([str(bundle_dir), "--repo-id", "org/tiny-loopvq", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "would upload 3 files" in printed and ".env" not in printed and ".git" not in printed
    assert push_bundle(bundle_dir, "org/tiny-loopvq") == listed
    assert fake_api.calls[-1] == ("upload_folder", str(bundle_dir), "org/tiny-loopvq", None, listed)


def test_invalid_bundle_or_repo_id_fails_before_any_upload(bundle_dir):
    (bundle_dir / "README.md").write_text("edited by hand")
    with pytest.raises(BundleError, match="README.md"):
        push_bundle(bundle_dir, "org/name", dry_run=True)
    with pytest.raises(PushError, match="ORG/NAME"):
        push_bundle(GOLDEN, "not a repo", dry_run=True)
    with pytest.raises(PushError, match="namespace"):
        push_bundle(GOLDEN, "just-a-name", dry_run=True)

    assert push_main([str(GOLDEN), "--repo-id", "just-a-name", "--dry-run"]) == 2  # bad input, not a failed push


def test_offline_push_fails_at_once_with_a_clear_message(bundle_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PushError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
        push_bundle(bundle_dir, "org/tiny-loopvq")


def test_push_creates_repo_then_uploads(bundle_dir, fake_api):
    files = push_bundle(bundle_dir, "org/tiny-loopvq", private=True, token="hf_x", revision="v1")
    assert fake_api.calls == [
        ("init", "hf_x"),
        ("create_repo", "org/tiny-loopvq", True, True),
        ("create_branch", "org/tiny-loopvq", "v1", True),
        ("upload_folder", str(bundle_dir), "org/tiny-loopvq", "v1", files),
    ]


def test_network_and_auth_errors_become_push_errors(bundle_dir, fake_api):
    fake_api.fail = ConnectionError("Name or service not known")
    with pytest.raises(PushError, match="could not reach the Hugging Face Hub"):
        push_bundle(bundle_dir, "org/x")
    fake_api.fail = OfflineModeIsEnabled("offline")
    with pytest.raises(PushError, match="offline mode"):
        push_bundle(bundle_dir, "org/x")

    http = importlib.import_module(HfHubHTTPError.__mro__[1].__module__)  # httpx (hub 1.x) or httpx2 (hub 2.x)
    response = http.Response(401, request=http.Request("POST", "https://huggingface.co/api/repos/create"))
    fake_api.fail = HfHubHTTPError("401 Unauthorized", response=response)
    with pytest.raises(PushError, match="not authorised.*HF_TOKEN"):
        push_bundle(bundle_dir, "org/x")
