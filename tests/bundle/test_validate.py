"""loopvq.json against docs/bundle-format.md (bundle/validate.py): every field's value and what the fields imply
together, on a real bundle corrupted one field at a time and resealed (meta_sha256 recomputed, as a writer with
that bug would), so that only the rule under test can refuse it; load_bundle and loopvq-inspect alike."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import write_tiny_bundle

from loopvq_calib.bundle.format import meta_bytes
from loopvq_calib.bundle.reader import BundleError, inspect_bundle, load_bundle
from loopvq_calib.cli import inspect_main
from loopvq_calib.config.methods import QuantMethod, register_method, unregister_method

Edit = Callable[[dict[str, Any]], None]


@pytest.fixture
def bundle_dir(tmp_path, tiny_ouro_dir) -> Path:
    """tasq+loopvq, K 16, G 8, T_c 4 on 4 heads of 16: blocks key.b0.l0, value.b0.l0, key.b0.l1, value.b0.l1."""
    return write_tiny_bundle(tmp_path / "bundle", tiny_ouro_dir)


def reseal(folder: Path, edit: Edit) -> None:
    meta = json.loads((folder / "loopvq.json").read_text())
    edit(meta)
    (folder / "loopvq.json").write_bytes(meta_bytes(meta))


def setting(*path: Any, value: Any) -> Edit:
    def edit(meta: dict[str, Any]) -> None:
        node = meta
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def both(*edits: Edit) -> Edit:
    def edit(meta: dict[str, Any]) -> None:
        for e in edits:
            e(meta)

    return edit


CASES = [
    (setting("rope", "theta", value=-1.0), r"field rope\.theta must be a finite number > 0, got -1\.0"),
    (setting("rope", "theta", value=0), r"field rope\.theta must be a finite number > 0, got 0"),
    (setting("rope", "theta", value="1e4"), r"field rope\.theta has the wrong type \(str\)"),
    (setting("rope", "theta", value=True), r"field rope\.theta has the wrong type \(bool\)"),
    (setting("rope", "style", value="bogus"), r"field rope\.style is 'bogus', not one of half, interleaved"),
    (setting("method", value="vq"), r"field method is 'vq', not one of cq, tasq, loopvq, tasq\+loopvq"),
    (setting("codebook_sharing", value="rows"), r"field codebook_sharing is 'rows', not one of none, heads"),
    (setting("codebook_dtype", value="int8"), r"field codebook_dtype is 'int8', not one of float32, bfloat16"),
    (setting("index_dtype", value="int32"), r"field index_dtype is 'int32'; codebook_size 16 needs 'uint8'"),
    (setting("kv_layout", "sites", 0, "stage", value="middle"), r"field kv_layout\.sites\[0\]\.stage is 'middle'"),
    (setting("blocks", 0, "kind", value="query"), r"field blocks\[0\]\.kind is 'query', not one of key, value"),
    (setting("codebook_size", value=12), r"field codebook_size must be a power of two >= 2, got 12"),
    (setting("codebook_size", value=32), r"field bits_detail\.index is 0\.5, but K=32, G=8, .* give 0\.625"),
    (setting("group_size", value=0), r"field group_size must be >= 1, got 0"),
    (setting("bits", "key", value=0.5), r"field bits\.key is 0\.5, but K=16, G=8, TaSQ sigma over H\*D=64 give 0\.75"),
    (setting("bits", "value", value=0.75), r"field bits\.value is 0\.75, but K=16, G=8, .* give 0\.5"),
    (setting("bits_detail", "key_sigma", value=0.0), r"field bits_detail\.key_sigma is 0\.0, .* give 0\.25"),
    (
        setting("codebook_bytes", value=16384),
        r"field codebook_bytes is 16384, but the blocks' codebooks hold 16384 "
        r"float16 values = 32768 bytes",
    ),
    (setting("codebook_dtype", value="float32"), r"field codebook_bytes is 32768, .* float32 values = 65536"),
    (setting("steps_per_block", value=3), r"field steps_per_block 3 does not divide kv_layout\.loop_steps 4"),
    (setting("kv_layout", "head_dim", value=15), r"field kv_layout\.head_dim must be a positive even number"),
    (setting("created", value="yesterday"), r"field created is 'yesterday', not a UTC time"),
    (setting("created", value="2026-13-01T00:00:00Z"), r"field created is '2026-13-01T00:00:00Z', not a UTC time"),
    (setting("name", value=" "), r"field name is empty"),
    (setting("format_version", value="1.x"), r"field format_version is missing or not 'major\.minor' \(got '1\.x'\)"),
    (setting("model", "config_sha256", value="abc"), r"field model\.config_sha256 is not 64 lowercase hex digits"),
    (setting("model", "weights_sha256", value="0" * 64), r"field model\.weights_sha256 is not the sha256 of model"),
    (setting("kv_layout", "sites", 1, "site", value=0), r"field kv_layout\.sites\[1\]\.site 0 is negative or repeated"),
    (setting("kv_layout", "sites", 0, "looped", value=False), r"sites\[0\]\.looped is False but stage is 'loop'"),
    (setting("kv_layout", "sites", 0, "step", value=9), r"field kv_layout\.sites\[0\]\.step 9 is outside 0\.\.3"),
    (setting("files", "README.md", "sha256", value="xyz"), r"field files\.README\.md\.sha256 is not 64 lowercase"),
    (setting("files", "README.md", "bytes", value=-1), r"field files\.README\.md\.bytes must be a non-negative"),
    (setting("serving", "page_size", value=True), r"field serving\.page_size has the wrong type \(bool\)"),
    (
        setting("blocks", 1, "tasq", value=True),
        r"block 'value\.b0\.l0': field tasq is true, but TaSQ applies to key "
        r"blocks of methods tasq, tasq\+loopvq only",
    ),
    (setting("method", value="loopvq"), r"block 'key\.b0\.l0': field tasq is true, .* key block of 'loopvq'"),
    (setting("blocks", 0, "sigma_min", value=0), r"block 'key\.b0\.l0': field sigma_min must be a finite number > 0"),
    (setting("blocks", 1, "sigma_min", value=0.1), r"block 'value\.b0\.l0': field sigma_min must be null when tasq"),
    (
        setting("blocks", 0, "sites", value=[6, 4, 2, 0]),
        r"block 'key\.b0\.l0': field sites \[6, 4, 2, 0\] \(steps "
        r"\[3, 2, 1, 0\]\) are not the 4 consecutive loop steps",
    ),
    (setting("blocks", 0, "sites", value=[0, 3, 4, 6]), r"field sites \[0, 3, 4, 6\] span more than one layer"),
    (setting("blocks", 0, "sites", value=["0"]), r"field blocks\[0\]\.sites must be a list of non-negative integers"),
    (
        both(setting("method", value="cq"), setting("blocks", 0, "tasq", value=False)),
        r"field steps_per_block must be 1 for method 'cq', got 4",
    ),
]


@pytest.mark.parametrize("edit,message", CASES)
def test_each_rule_of_the_spec_refuses_a_bundle_naming_the_file_and_the_field(bundle_dir, capsys, edit, message):
    reseal(bundle_dir, edit)
    for read in (load_bundle, inspect_bundle):
        with pytest.raises(BundleError) as err:
            read(bundle_dir)
        assert str(err.value).startswith(f"{bundle_dir / 'loopvq.json'}: ") and re.search(message, str(err.value))
    assert inspect_main([str(bundle_dir)]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_unknown_fields_are_ignored_and_known_ones_pass(bundle_dir):
    """Minor versions add optional fields: readers ignore them at every level."""
    before = load_bundle(bundle_dir).meta
    reseal(
        bundle_dir,
        both(
            setting("a_future_field", value={"x": 1}),
            setting("rope", "scaling", value=None),
            setting("kv_layout", "sites", 0, "note", value="new"),
            setting("blocks", 0, "hint", value=[1, 2]),
        ),
    )
    bundle = load_bundle(bundle_dir)
    assert bundle.meta["a_future_field"] == {"x": 1} and bundle.meta["kv_layout"]["sites"][0]["note"] == "new"
    assert bundle.quantizer.kv.sites[0].site == 0 and bundle.meta["rope"]["theta"] == before["rope"]["theta"] > 0


@pytest.mark.parametrize(
    "method,edit,message",
    [
        (
            QuantMethod("toytasq", loop_layout="loop-axis", tasq_groupings=("free",)),
            setting("blocks", 1, "tasq", value=True),
            (
                r"TaSQ applies to key blocks of methods tasq, tasq\+loopvq, toytasq only "
                r"\(this is a value block of 'toytasq'\)"
            ),
        ),
        (
            QuantMethod("toycq"),
            setting("blocks", 0, "tasq", value=False),
            r"field steps_per_block must be 1 for method 'toycq', got 4",
        ),
    ],
)
def test_the_method_rules_are_the_registered_declarations(bundle_dir, method, edit, message):
    register_method(method)
    try:
        reseal(bundle_dir, setting("method", value=method.name))
        if method.uses_tasq:
            assert load_bundle(bundle_dir).quantizer.method == method.name  # a TaSQ loop-axis method, as tasq+loopvq
        reseal(bundle_dir, edit)
        with pytest.raises(BundleError, match=message):
            load_bundle(bundle_dir)
    finally:
        unregister_method(method.name)
