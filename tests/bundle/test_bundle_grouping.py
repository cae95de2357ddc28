"""Format 1.2's optional ``grouping: "channels"`` of key blocks: the writer sets it exactly on the TaSQ key blocks of
several steps whose codes hold the same channels, whole RoPE pairs, at every step, and writes 1.2 then (1.1
otherwise); the reader checks it against the groups and refuses a flag that does not match, naming the block; a
1.1 reader's view of the bundle (the flag dropped) reads the same quantizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_quantizer, write_tiny_bundle
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.decode import channels_groups

from loopvq_calib.bundle.reader import BundleError, inspect_bundle, load_bundle
from loopvq_calib.codes.quantizer import KVQuantizer


def channels_quantizer(model_dir: Path) -> KVQuantizer:
    """The tiny quantizer (TaSQ+LoopVQ, G 8, T_c 4, half-split RoPE) with channels layouts for its keys."""
    q = tiny_quantizer(model_dir)
    for codec in q.codecs.values():
        lay = codec.layout
        if lay.kind == "key":
            lay.groups = channels_groups(lay.kv_heads, lay.steps, lay.head_dim, lay.group_size, "half", seed=7)
    return q


def same_channels_every_step(groups: torch.Tensor, d: int, steps: int) -> bool:
    """The property from the format text: every code's channels at step m (coordinate // D == m) are the same set
    at every step, and that set holds both channels of each half-split pair (i, i + D/2)."""
    for head in groups.tolist():
        for code in head:
            sets = [sorted(c % d for c in code if c // d == m) for m in range(steps)]
            if any(s != sets[0] for s in sets) or any((c + d // 2) % d not in sets[0] for c in sets[0]):
                return False
    return True


def _meta(path: Path) -> dict:
    return json.loads((path / "loopvq.json").read_text())


def _reseal(path: Path, meta: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite codebooks.safetensors (when given, with the meta's format version) and loopvq.json (its files entry
    updated, no metadata checksum), as a writer that does not check its output would."""
    if tensors is not None:
        file = path / "codebooks.safetensors"
        save_file(tensors, str(file), metadata={"format": "loopvq", "format_version": meta["format_version"]})
        meta["files"]["codebooks.safetensors"] = {
            "sha256": hashlib.sha256(file.read_bytes()).hexdigest(),
            "bytes": file.stat().st_size,
        }
    (path / "loopvq.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "meta_sha256"}))


def test_the_writer_flags_channels_key_blocks_and_writes_1_2(tmp_path, tiny_ouro_dir):
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, quantizer=channels_quantizer(tiny_ouro_dir))
    meta, tensors = _meta(path), load_file(str(path / "codebooks.safetensors"))
    d = meta["kv_layout"]["head_dim"]
    assert meta["format_version"] == "1.2"
    with safe_open(str(path / "codebooks.safetensors"), "pt") as f:
        assert f.metadata()["format_version"] == "1.2"
    for block in meta["blocks"]:
        flagged = block.get("grouping") == "channels"
        assert flagged == (block["kind"] == "key"), block["key"]
        assert same_channels_every_step(tensors[f"{block['key']}.groups"], d, len(block["sites"])) == flagged
    assert "groups [4, 8, 8] +tasq grouping=channels" in inspect_bundle(path)
    assert all(
        torch.equal(load_bundle(path).quantizer.codecs[k].layout.groups, tensors[f"{k}.groups"].long())
        for k in ("key.b0.l0", "key.b0.l1")
    )


def test_a_bundle_without_channels_layouts_stays_1_1(tmp_path, tiny_ouro_dir):
    """The half-split loop-axis keys of the tiny quantizer hold half pairs: no flag, the 1.1 format."""
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir)
    meta, tensors = _meta(path), load_file(str(path / "codebooks.safetensors"))
    assert meta["format_version"] == "1.1" and not any("grouping" in b for b in meta["blocks"])
    assert not same_channels_every_step(tensors["key.b0.l0.groups"], meta["kv_layout"]["head_dim"], 4)


def test_a_flag_that_does_not_match_the_groups_is_refused(tmp_path, tiny_ouro_dir):
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir)
    meta = _meta(path)
    meta["format_version"] = "1.2"
    tensors = load_file(str(path / "codebooks.safetensors"))
    meta["blocks"][0]["grouping"] = "channels"  # key.b0.l0: loop-axis groups of half pairs
    _reseal(path, meta, tensors)
    with pytest.raises(
        BundleError,
        match=r"block 'key\.b0\.l0': field grouping is 'channels', but tensor "
        r"'key\.b0\.l0\.groups' does not hold the same channels, whole RoPE pairs "
        r"\(half\), at every step",
    ):
        load_bundle(path)
    meta["blocks"][0]["grouping"] = "free"
    _reseal(path, meta)
    with pytest.raises(BundleError, match=r"block 'key\.b0\.l0': field grouping is 'free', not 'channels'"):
        load_bundle(path)
    del meta["blocks"][0]["grouping"]
    value = next(b for b in meta["blocks"] if b["kind"] == "value")
    value["grouping"] = "channels"
    _reseal(path, meta)
    with pytest.raises(BundleError, match=rf"block '{value['key']}': field grouping is set on a value block"):
        load_bundle(path)


def test_groups_edited_under_a_flag_are_refused(tmp_path, tiny_ouro_dir):
    """Two coordinates of different channels swapped between codes: still a partition (a valid free layout),
    but code 0 no longer holds the same channels at every step."""
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, quantizer=channels_quantizer(tiny_ouro_dir))
    meta, tensors = _meta(path), load_file(str(path / "codebooks.safetensors"))
    groups = tensors["key.b0.l1.groups"].clone()
    groups[0, 0, 0], groups[0, 1, 0] = groups[0, 1, 0].item(), groups[0, 0, 0].item()
    _reseal(path, meta, {**tensors, "key.b0.l1.groups": groups})
    with pytest.raises(
        BundleError,
        match=r"block 'key\.b0\.l1': field grouping is 'channels', but tensor "
        r"'key\.b0\.l1\.groups' does not hold",
    ):
        load_bundle(path)
    meta["blocks"] = [{k: v for k, v in b.items() if k != "grouping"} for b in meta["blocks"]]
    _reseal(path, meta)
    assert load_bundle(path)  # without the flag: a free layout


def test_a_1_1_readers_view_reads_the_same_quantizer(tmp_path, tiny_ouro_dir):
    """The flag is optional: dropped (and the version 1.1, as a 1.1 reader sees the bundle), the bundle loads with
    the same groups, codebooks and weights."""
    path = write_tiny_bundle(tmp_path / "b", tiny_ouro_dir, quantizer=channels_quantizer(tiny_ouro_dir))
    flagged = load_bundle(path).quantizer
    meta, tensors = _meta(path), load_file(str(path / "codebooks.safetensors"))
    meta["format_version"] = "1.1"
    meta["blocks"] = [{k: v for k, v in b.items() if k != "grouping"} for b in meta["blocks"]]
    _reseal(path, meta, tensors)
    plain = load_bundle(path)
    assert plain.meta["format_version"] == "1.1"
    for key, codec in flagged.codecs.items():
        other = plain.quantizer.codecs[key]
        assert torch.equal(codec.layout.groups, other.layout.groups) and torch.equal(codec.codebook, other.codebook)
