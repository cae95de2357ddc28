"""Bundle format v1, the writer: write/load round trip, metadata and card, atomic replacement (the reader's
validation, identity checks and inspect: test_bundle_reader.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import TINY_G as G, TINY_K as K, TINY_T_C as T_C, tiny_quantizer, write_tiny_bundle
from safetensors import safe_open
from safetensors.torch import load_file

from loopvq_calib.bundle import writer
from loopvq_calib.bundle.format import BASE_VERSION
from loopvq_calib.bundle.reader import BundleError, load_bundle
from loopvq_calib.bundle.writer import write_bundle
from loopvq_calib.config.schema import ServingConfig
from loopvq_calib.models.loading import model_identity
from loopvq_calib.runtime.files import temp_sibling


def test_round_trip(tmp_path, tiny_ouro_dir):
    q = tiny_quantizer(tiny_ouro_dir)
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, quantizer=q)
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "codebooks.safetensors", "loopvq.json"]
    b = load_bundle(path, model=tiny_ouro_dir)
    for key, codec in q.codecs.items():
        got = b.quantizer.codecs[key]
        assert got.codebook.dtype == torch.float32
        assert torch.equal(got.codebook, codec.codebook.half().float())
        assert torch.equal(got.layout.groups, codec.layout.groups)
        assert (got.transform is None) == (codec.transform is None)
        if codec.transform is not None:
            assert torch.equal(got.transform.weight, codec.transform.weight)
    assert b.quantizer.kv == q.kv and b.quantizer.bits() == q.bits()
    m = b.meta
    assert m["format_version"] == BASE_VERSION and m["producer"] == {"name": "loopvq-calib", "version": "0.1.0"}
    assert m["created"].endswith("Z") and m["method"] == "tasq+loopvq" and m["index_dtype"] == "uint8"
    assert m["bits"] == {"key": 0.5 + 16 / (4 * 16), "value": 0.5}
    assert (m["codebook_size"], m["group_size"], m["steps_per_block"]) == (K, G, T_C)
    assert m["codebook_bytes"] == q.codebook_bytes(2) == 2 * 2 * (4 * 8 * K * G) * 2
    assert m["rope"] == {"style": "half", "theta": 10000.0} and "rope_style" not in m["kv_layout"]
    assert b.serving == {"sink_tokens": 8, "recent_window": 64, "page_size": 8}
    assert m["model"] == model_identity(tiny_ouro_dir, "org/tiny-ouro", "main").to_dict()
    assert m["metrics"]["heldout_kl"] == 0.0123 and "sigma" in m["sigma_rule"]
    assert set(m["files"]) == {"codebooks.safetensors", "README.md"}
    header = load_file(str(path / "codebooks.safetensors"))
    assert header["key.b0.l0.codebook"].dtype == torch.float16 and header["key.b0.l0.groups"].dtype == torch.int32


def test_safetensors_metadata_and_model_card(tmp_path, tiny_ouro_dir):
    bundle_dir = write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)
    with safe_open(str(bundle_dir / "codebooks.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "loopvq", "format_version": BASE_VERSION}
    card = (bundle_dir / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == "org/tiny-ouro" and front["library_name"] == "loopvq-calib"
    assert front["tags"] == ["loopvq", "kv-cache", "quantization", "vector-quantization", "looped-transformer", "ouro"]
    assert "license" not in front
    assert "0.0123" in card and "load_bundle" in card and "recent window" in card
    licensed = write_tiny_bundle(tmp_path / "lic", tiny_ouro_dir, config={"output": {"license": "apache-2.0"}})
    assert yaml.safe_load((licensed / "README.md").read_text().split("---")[1])["license"] == "apache-2.0"


def test_replaces_existing_bundle_and_refuses_other_folders(tmp_path, tiny_ouro_dir):
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, name="first")
    write_tiny_bundle(path, tiny_ouro_dir, name="second")
    assert load_bundle(path).meta["name"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary or backup folders left
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text("{}")
    with pytest.raises(BundleError, match="not a bundle"):
        write_tiny_bundle(tmp_path / "run", tiny_ouro_dir)
    assert (tmp_path / "run" / "manifest.json").is_file()
    (tmp_path / "empty").mkdir()
    assert load_bundle(write_tiny_bundle(tmp_path / "empty", tiny_ouro_dir)).meta["name"] == "tiny"


def test_non_finite_metrics_stay_strict_json(tmp_path, tiny_ouro_dir):
    q = tiny_quantizer(tiny_ouro_dir, method="loopvq", sharing="all")
    path = write_bundle(
        tmp_path / "b",
        q,
        name="nan",
        identity=model_identity(tiny_ouro_dir, "m"),
        calibration={},
        metrics={"heldout_kl": float("nan"), "ppl": torch.tensor(2.5)},
        serving=ServingConfig(0, 0, 8),
        codebook_dtype="bfloat16",
        config={},
        producer_version="0",
    )
    meta = json.loads((path / "loopvq.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert meta["metrics"] == {"heldout_kl": "nan", "ppl": 2.5} and meta["bits_detail"]["key_sigma"] == 0.0
    assert load_bundle(path).quantizer.codecs["key.b0.l0"].codebook.shape == (1, 1, K, G)


def test_failed_write_keeps_previous_bundle(tmp_path, tiny_ouro_dir, monkeypatch):
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, name="old")
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def boom(meta):
        raise RuntimeError("disk full")

    monkeypatch.setattr(writer, "model_card", boom)  # fails while the new bundle is being built
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_bundle(path, tiny_ouro_dir, name="new")
    with pytest.raises(RuntimeError, match="disk full"):
        write_tiny_bundle(tmp_path / "fresh", tiny_ouro_dir)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert load_bundle(path).meta["name"] == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no partial folder under any name


def test_write_bundle_never_replaces_a_folder_with_other_files(tmp_path, tiny_ouro_dir):
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, name="old")
    (path / ".env").write_text("HF_TOKEN=secret")
    with pytest.raises(BundleError, match=r"holds files that are not part of the bundle \(\.env\)"):
        write_tiny_bundle(path, tiny_ouro_dir, name="new")
    assert (path / ".env").read_text() == "HF_TOKEN=secret" and load_bundle(path).meta["name"] == "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".loopvq-tmp.")]


def test_leftovers_of_a_dead_process_with_this_process_id_do_not_block_a_write(tmp_path, tiny_ouro_dir):
    """The temporary folders are named for the writing process (runtime.files.temp_sibling): a killed writer
    whose id this process now has left its build folder and its moved-aside bundle; both are cleared."""
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, name="first")
    for leftover in (temp_sibling(path), temp_sibling(path.with_name("b.old"))):
        leftover.mkdir()
        (leftover / "loopvq.json").write_text("{half")
    write_tiny_bundle(path, tiny_ouro_dir, name="second")
    assert load_bundle(path).meta["name"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
