"""Bundle format v1, the reader: every validation error, the model identity check, bundles from the hub cache,
inspect."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_ouro, save_with_tokenizer, write_tiny_bundle
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

from loopvq_calib.bundle.reader import BundleError, inspect_bundle, load_bundle, meta_checksum
from loopvq_calib.models.loading import model_identity


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    """Another tiny Ouro whose config differs (rope_theta); other seeds differ by content hash."""
    return save_with_tokenizer(make_tiny_ouro(seed=1, rope_theta=20000.0), tmp_path_factory.mktemp("ouro-b"))


@pytest.fixture
def bundle_dir(tmp_path, tiny_ouro_dir) -> Path:
    return write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)


def _meta(path: Path) -> dict:
    return json.loads((path / "loopvq.json").read_text())


def _set_meta(path: Path, meta: dict) -> None:
    """Rewrite loopvq.json without its metadata checksum (as a pre-1.1 writer did), so the reader's other
    checks are reached; test_edited_metadata_is_refused covers edits to a checksummed file."""
    (path / "loopvq.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"}))


def _rewrite_tensors(
    path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None, meta: dict | None = None
) -> None:
    """Replace codebooks.safetensors (header ``metadata``) and record its checksum in ``meta`` (default: the
    bundle's loopvq.json), as a buggy writer would."""
    file = path / "codebooks.safetensors"
    meta = meta or _meta(path)
    save_file(tensors, str(file), metadata=metadata or {"format": "loopvq", "format_version": meta["format_version"]})
    meta["files"]["codebooks.safetensors"] = {
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
        "bytes": file.stat().st_size,
    }
    _set_meta(path, meta)


@pytest.mark.parametrize(
    "field,value,resealed_error",
    [
        (("name",), "renamed", None),
        (("model", "config_sha256"), "0" * 64, None),
        (
            ("model", "model_type"),
            "llama",
            r"field model\.model_type 'llama' differs from kv_layout\.model_type 'ouro'",
        ),
        (("model", "weights", 0, "sample_sha256"), "f" * 64, r"field model\.weights_sha256 is not the sha256 of model"),
        (("metrics", "heldout_kl"), 0.0001, None),
    ],
)
def test_edited_metadata_is_refused(bundle_dir, field, value, resealed_error):
    """loopvq.json carries meta_sha256 (its bytes with the value zeroed); any edit is refused by load_bundle
    and inspect, while the same edit with the checksum recomputed (a re-sealing writer) loads unless it breaks
    another rule (one model type; weights_sha256 over the weights)."""
    raw = (bundle_dir / "loopvq.json").read_bytes()
    meta = json.loads(raw)
    assert meta["meta_sha256"] == hashlib.sha256(raw.replace(meta["meta_sha256"].encode(), b"0" * 64)).hexdigest()
    node = meta
    for key in field[:-1]:
        node = node[key]
    old = json.dumps(node[field[-1]])
    assert old.encode() in raw
    edited = raw.replace(old.encode(), json.dumps(value).encode(), 1)
    (bundle_dir / "loopvq.json").write_bytes(edited)
    for read in (load_bundle, inspect_bundle):
        with pytest.raises(BundleError, match=r"loopvq\.json: metadata checksum mismatch \(field meta_sha256\)"):
            read(bundle_dir)
    resealed = edited.replace(meta["meta_sha256"].encode(), b"0" * 64)
    resealed = (
        resealed.replace(b"0" * 64, meta_checksum(resealed).encode(), 1) if field[-1] != "config_sha256" else None
    )
    if resealed is not None:
        (bundle_dir / "loopvq.json").write_bytes(resealed)
        if resealed_error is None:
            assert load_bundle(bundle_dir).meta["meta_sha256"] != meta["meta_sha256"]
        else:
            with pytest.raises(BundleError, match=resealed_error):
                load_bundle(bundle_dir)


def test_checksum_mismatch(bundle_dir):
    file = bundle_dir / "codebooks.safetensors"
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"codebooks\.safetensors: checksum mismatch"):
        load_bundle(bundle_dir)


def test_truncated_safetensors(bundle_dir):
    file = bundle_dir / "codebooks.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleError, match="size mismatch.*truncated"):
        load_bundle(bundle_dir)
    meta = _meta(bundle_dir)  # a writer that recorded the truncated file's checksum
    meta["files"]["codebooks.safetensors"] = {
        "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
        "bytes": file.stat().st_size,
    }
    _set_meta(bundle_dir, meta)
    with pytest.raises(BundleError, match=r"codebooks\.safetensors: not a readable safetensors file"):
        load_bundle(bundle_dir)


def test_missing_files(bundle_dir, tmp_path):
    (bundle_dir / "README.md").unlink()
    with pytest.raises(BundleError, match=r"README\.md: missing"):
        load_bundle(bundle_dir)
    (bundle_dir / "loopvq.json").unlink()
    with pytest.raises(BundleError, match=r"loopvq\.json: missing"):
        load_bundle(bundle_dir)
    with pytest.raises(BundleError, match="nowhere: no such bundle folder"):
        load_bundle(tmp_path / "nowhere")


def test_format_versions(bundle_dir):
    meta = _meta(bundle_dir)
    _set_meta(bundle_dir, {**meta, "format_version": "2.0"})
    with pytest.raises(BundleError, match=r"format_version 2\.0 is not supported.*supports 1\.x"):
        load_bundle(bundle_dir)
    tensors = load_file(str(bundle_dir / "codebooks.safetensors"))
    future = {**meta, "format_version": "1.7", "a_future_optional_field": {"x": 1}}
    _rewrite_tensors(bundle_dir, tensors, {"format": "loopvq", "format_version": "1.7"}, meta=future)
    assert load_bundle(bundle_dir).meta["format_version"] == "1.7"
    _rewrite_tensors(bundle_dir, tensors, {"format": "loopvq", "format_version": "1.1"}, meta=future)  # vs 1.7
    with pytest.raises(
        BundleError,
        match=r"codebooks\.safetensors: safetensors metadata format_version '1\.1' "
        r"differs from field format_version '1\.7' of loopvq\.json",
    ):
        load_bundle(bundle_dir)
    _rewrite_tensors(bundle_dir, tensors, {"format": "loopvq"}, meta=future)  # a header without a version
    assert load_bundle(bundle_dir).meta["format_version"] == "1.7"
    meta = _meta(bundle_dir)
    _set_meta(bundle_dir, {**meta, "blocks": meta["blocks"][1:]})
    with pytest.raises(BundleError, match=r"key blocks must cover every KV site exactly once \(missing \[0, 2, 4, 6\]"):
        load_bundle(bundle_dir)
    del meta["blocks"]
    _set_meta(bundle_dir, meta)
    with pytest.raises(BundleError, match="required field blocks is missing"):
        load_bundle(bundle_dir)


@pytest.mark.parametrize(
    "path,value,message",
    [
        (("name",), None, "required field name is missing"),
        (("codebook_bytes",), None, "required field codebook_bytes is missing"),
        (("model", "weights"), None, "required field model.weights is missing"),
        (("bits", "key"), None, "required field bits.key is missing"),
        (("producer", "version"), 3, "field producer.version has the wrong type"),
        (("serving", "page_size"), 0, "serving.page_size must be > 0"),
        (("serving", "sink_tokens"), -8, "serving.sink_tokens must be a non-negative multiple of page_size"),
        (("serving", "recent_window"), 12, "serving.recent_window must be a non-negative multiple of page_size"),
    ],
)
def test_required_fields_and_serving_values(bundle_dir, path, value, message):
    """Every field docs/bundle-format.md marks as present in 1.0 is checked (inspect never hits a KeyError)."""
    meta = _meta(bundle_dir)
    node = meta
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    _set_meta(bundle_dir, meta)
    with pytest.raises(BundleError, match=message):
        inspect_bundle(bundle_dir)


def test_tensor_validation(bundle_dir):
    tensors = load_file(str(bundle_dir / "codebooks.safetensors"))
    cases = [
        ({k: v for k, v in tensors.items() if k != "value.b0.l1.codebook"}, r"'value\.b0\.l1\.codebook'.*is missing"),
        (
            {**tensors, "key.b9.l0.codebook": tensors["key.b0.l0.codebook"].clone()},
            r"not described.*key\.b9\.l0\.codebook",
        ),
        (
            {**tensors, "key.b0.l0.codebook": tensors["key.b0.l0.codebook"][:, :, :8].contiguous()},
            r"'key\.b0\.l0\.codebook' has shape \[4, 8, 8, 8\].*needs \[4, 8, 16, 8\]",
        ),
        (
            {**tensors, "value.b0.l0.codebook": tensors["value.b0.l0.codebook"].float()},
            r"'value\.b0\.l0\.codebook' has dtype torch\.float32, expected torch\.float16",
        ),
        (
            {**tensors, "key.b0.l0.groups": tensors["key.b0.l0.groups"].flip(-1) * 0},
            r"'key\.b0\.l0\.groups'.*do not cover",
        ),
        ({**tensors, "key.b0.l1.tasq_weight": tensors["key.b0.l1.tasq_weight"] * 0}, "zero weights"),
    ]
    for broken, message in cases:
        _rewrite_tensors(bundle_dir, broken)
        with pytest.raises(BundleError, match=message):
            load_bundle(bundle_dir)
    _rewrite_tensors(bundle_dir, tensors)
    assert load_bundle(bundle_dir)


def test_identity_mismatch(bundle_dir, tiny_ouro_dir, model_b, tmp_path):
    assert load_bundle(bundle_dir, model=tiny_ouro_dir, identity=model_identity(tiny_ouro_dir, "any-name"))
    with pytest.raises(BundleError, match=r"calibrated for 'org/tiny-ouro'.*config\.json sha256"):
        load_bundle(bundle_dir, model=model_b)
    with pytest.raises(BundleError, match=r"model identity b differs: config\.json sha256"):
        load_bundle(bundle_dir, identity=model_identity(model_b, "b"))
    resharded = tmp_path / "resharded"  # same config.json, different weight files
    make_tiny_ouro(seed=0).save_pretrained(resharded, max_shard_size="1MB")
    with pytest.raises(BundleError, match=r"weight file model\.safetensors missing from the model"):
        load_bundle(bundle_dir, model=resharded)
    with pytest.raises(BundleError, match="cannot compute the identity"):
        load_bundle(bundle_dir, model=tmp_path / "no-such-model")


def test_identity_detects_other_weights_with_same_layout(bundle_dir, tmp_path):
    """Same config and tensor layout, other weight values (a fine-tune): the content hash differs."""
    other = save_with_tokenizer(make_tiny_ouro(seed=1), tmp_path / "same-layout")
    with pytest.raises(BundleError, match="sample_sha256|weights"):
        load_bundle(bundle_dir, model=other)


def test_hub_cache_and_plain_copy_of_the_same_model_match(tmp_path, tiny_ouro_dir):
    """A model read from the hub cache (weights as symlinks to blobs named by their sha256) and a plain copy
    of the same files describe their weights differently (sha256 only in the cache) but are the same model."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for f in tiny_ouro_dir.iterdir():
        if f.suffix == ".safetensors":
            blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, blob)
            (snapshot / f.name).symlink_to(blob)
        else:
            shutil.copy(f, snapshot / f.name)
    cached = model_identity(snapshot, "org/tiny-ouro")
    assert all("sha256" in w and "sample_sha256" in w for w in cached.weights)
    assert all("sha256" not in w for w in model_identity(tiny_ouro_dir, "org/tiny-ouro").weights)
    bundle = write_tiny_bundle(tmp_path / "bundle", snapshot)
    assert load_bundle(bundle, model=tiny_ouro_dir)  # calibrated from the cache, served from a plain copy
    other = save_with_tokenizer(make_tiny_ouro(seed=1), tmp_path / "same-layout")
    with pytest.raises(BundleError, match="sample_sha256"):
        load_bundle(bundle, model=other)


def test_inspect(bundle_dir):
    text = inspect_bundle(bundle_dir)
    for needle in (
        "tasq+loopvq",
        "key 0.7500  value 0.5000",
        "K=16  G=8  T_c=4  sharing=none",
        "float16",
        "blocks      4 (2 key), 128 codebooks",
        "codebooks 32,768 bytes",
        "org/tiny-ouro",
        "sink tokens 8, recent window 64, page size 8",
        "heldout_kl: 0.0123",
        "ppl_increase: 0.021",
        "codebook [4, 8, 16, 8]  groups [1, 8, 8] +tasq",
        "8 sites, 4 loop steps, 4 KV heads, head dim 16",
    ):
        assert needle in text, needle
    (bundle_dir / "README.md").write_text("changed")
    with pytest.raises(BundleError, match="checksum|size"):
        inspect_bundle(bundle_dir)


def test_a_bundle_by_hub_id_comes_from_the_hub_cache(bundle_dir, tmp_path, monkeypatch):
    """load_bundle('org/name') reads the hub cache's snapshot (offline: only the cache); a missing id or a
    mistyped local path is named, never a network error."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-bundle"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(bundle_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_bundle("org/tiny-bundle")
    assert loaded.path == repo / "snapshots" / commit and loaded.meta == load_bundle(bundle_dir).meta
    with pytest.raises(BundleError, match=r"bundle: could not get the bundle 'org/other' .*not in the local hub cache"):
        load_bundle("org/other")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BundleError, match=r"^hub/typo: no such bundle folder$"):
        load_bundle("hub/typo")  # hub/ exists here: a local path, not a hub id
