"""What reader, writer and push share (bundle/format.py): strict JSON (no duplicate keys, no bare NaN or
Infinity), the names ``files`` may list, and files reached only inside the bundle folder (no symlink out of it;
a hub-cache snapshot's links to its own blobs only)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import write_tiny_bundle
from huggingface_hub import constants

from loopvq_calib.bundle.format import (
    BundleError,
    bundle_file,
    file_name_problem,
    hub_blobs,
    meta_bytes,
    read_bundle_file,
    strict_json,
)
from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.cli import inspect_main

FILE = Path("b/loopvq.json")


@pytest.fixture
def bundle_dir(tmp_path, tiny_ouro_dir) -> Path:
    return write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"rope": {"style": "half", "theta": NaN}}', r"field rope\.theta is a bare NaN, which is not JSON"),
        ('{"metrics": {"curve": [1.0, Infinity]}}', r"field metrics\.curve\[1\] is a bare Infinity"),
        ('{"x": -Infinity}', r"field x is a bare -Infinity"),
        ('{"rope": {"theta": 1.0, "theta": 2.0}}', r"field rope\.theta appears more than once \(duplicate JSON key\)"),
        ('{"name": "a", "blocks": [{"key": "k", "key": "k"}], "name": "b"}', r"field name appears more than once"),
        ('{"blocks": [{}, {"sites": [], "sites": [1]}]}', r"field blocks\[1\]\.sites appears more than once"),
        ('{"a": 1', r"not valid JSON \(Expecting"),
    ],
)
def test_strict_json_refuses_what_plain_json_loads_accepts(text, message):
    with pytest.raises(BundleError, match=f"^b/loopvq\\.json: {message}"):
        strict_json(text.encode(), FILE)


def test_strict_json_returns_plain_values():
    text = '{"a": [1, 2.5, {"b": null}], "c": "nan", "d": true}'
    parsed = strict_json(text.encode(), FILE)
    assert parsed == json.loads(text) and type(parsed) is dict and type(parsed["a"][2]) is dict


@pytest.mark.parametrize(
    "old,new,message",
    [
        (b'"theta": 10000.0', b'"theta": NaN', r"field rope\.theta is a bare NaN"),
        (b'"theta": 10000.0', b'"theta": Infinity', r"field rope\.theta is a bare Infinity"),
        (b'"theta": 10000.0', b'"theta": -1.0, "theta": 10000.0', r"field rope\.theta appears more than once"),
        (b'"codebook_size": 16', b'"codebook_size": 256, "codebook_size": 16', r"field codebook_size appears more"),
    ],
)
def test_a_bundle_whose_metadata_is_not_strict_json_is_refused(bundle_dir, capsys, old, new, message):
    raw = (bundle_dir / "loopvq.json").read_bytes()
    assert raw.count(old) == 1
    (bundle_dir / "loopvq.json").write_bytes(raw.replace(old, new))
    with pytest.raises(BundleError, match=f"{bundle_dir / 'loopvq.json'}: {message}"):
        load_bundle(bundle_dir)
    assert inspect_main([str(bundle_dir)]) == 2 and re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    "name,problem",
    [
        ("README.md", None),
        ("sub/dir/file.bin", None),
        (".gitattributes", None),
        ("a b-c_d.e", None),
        ("", "is not a non-empty string"),
        ("/etc/passwd", "is an absolute path"),
        ("..", "has an empty, '.' or '..' component"),
        ("../x", "has an empty, '.' or '..' component"),
        ("./README.md", "has an empty, '.' or '..' component"),
        ("a//b", "has an empty, '.' or '..' component"),
        ("a/", "has an empty, '.' or '..' component"),
        ("a\\b", "contains a backslash (paths use '/')"),
        ("*", "contains a glob character (* ? [ ])"),
        ("card[1].md", "contains a glob character (* ? [ ])"),
        ("?.md", "contains a glob character (* ? [ ])"),
        ("a\nb", "contains a control character"),
    ],
)
def test_the_names_files_may_list(name, problem):
    assert file_name_problem(name) == problem


def _relist(folder: Path, name: str, content_of: Path, *, drop: str | None = None) -> None:
    """List ``name`` under files with the checksum of ``content_of`` (what a writer following links records),
    ``drop`` no longer."""
    meta = json.loads((folder / "loopvq.json").read_text())
    meta["files"].pop(drop, None)
    data = content_of.read_bytes()
    meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "loopvq.json").write_bytes(meta_bytes(meta))


def test_the_reader_follows_no_symlink_out_of_the_bundle(bundle_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the bundle")
    (bundle_dir / "notes.txt").symlink_to(secret)
    _relist(bundle_dir, "notes.txt", secret)
    with pytest.raises(
        BundleError,
        match=r"bundle/notes\.txt: files entry 'notes\.txt' is or passes through a "
        r"symbolic link",
    ):
        load_bundle(bundle_dir)
    (bundle_dir / "notes.txt").unlink()
    (tmp_path / "outside").mkdir()
    shutil.copy(secret, tmp_path / "outside" / "notes.txt")
    (bundle_dir / "docs").symlink_to(tmp_path / "outside", target_is_directory=True)
    _relist(bundle_dir, "docs/notes.txt", secret, drop="notes.txt")
    with pytest.raises(BundleError, match=r"bundle/docs: files entry 'docs/notes\.txt' is or passes through"):
        load_bundle(bundle_dir)
    meta_file = bundle_dir / "loopvq.json"
    shutil.move(meta_file, tmp_path / "loopvq.json")
    meta_file.symlink_to(tmp_path / "loopvq.json")
    with pytest.raises(BundleError, match=r"bundle/loopvq\.json: files entry 'loopvq\.json' is or passes through"):
        load_bundle(bundle_dir)


def test_a_listed_name_that_is_no_regular_file_is_refused(bundle_dir):
    (bundle_dir / "codebooks.safetensors").rename(bundle_dir / "moved")
    (bundle_dir / "codebooks.safetensors").mkdir()
    with pytest.raises(
        BundleError,
        match=r"codebooks\.safetensors: files entry 'codebooks\.safetensors' is not a "
        "regular file",
    ):
        load_bundle(bundle_dir)
    with pytest.raises(
        BundleError,
        match=r"bundle/README\.md: files entry 'README\.md/x' passes through something "
        "that is not a folder",
    ):
        bundle_file(bundle_dir, "README.md/x")
    with pytest.raises(BundleError, match=r"bundle/gone\.md: missing \(listed in loopvq\.json\)"):
        bundle_file(bundle_dir, "gone.md")


def _snapshot(bundle: Path, cache: Path, repo: str = "models--org--tiny-bundle") -> Path:
    """``bundle`` laid out as the hub cache does: files as blobs named by their sha256, the snapshot's files
    relative symlinks to them."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot, blobs = cache / repo / "snapshots" / commit, cache / repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in bundle.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (cache / repo / "refs").mkdir()
    (cache / repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_hub_cache_snapshot_may_link_to_its_own_blobs_only(bundle_dir, tmp_path, monkeypatch):
    snapshot = _snapshot(bundle_dir, tmp_path / "hub")
    assert hub_blobs(snapshot) == tmp_path / "hub" / "models--org--tiny-bundle" / "blobs"
    assert hub_blobs(bundle_dir) is None
    assert load_bundle(snapshot).meta == load_bundle(bundle_dir).meta  # snapshot_download's folder, as the card says
    monkeypatch.chdir(snapshot.parent.parent)
    assert load_bundle(Path("snapshots") / snapshot.name).meta["name"] == "tiny"  # a relative path to it too
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_bundle("org/tiny-bundle").path == snapshot
    with pytest.raises(BundleError, match=r"README\.md' is or passes through a symbolic link"):
        read_bundle_file(snapshot, "README.md")  # what a push reads: no link at all
    outside = tmp_path / "card.md"
    shutil.copy(bundle_dir / "README.md", outside)
    (snapshot / "README.md").unlink()
    (snapshot / "README.md").symlink_to(outside)  # same bytes, outside the blobs
    with pytest.raises(
        BundleError,
        match=r"snapshots/0123456789abcdef0123456789abcdef01234567/README\.md: files "
        "entry 'README.md' is or passes through a symbolic link",
    ):
        load_bundle(snapshot)
