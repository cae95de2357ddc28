"""KVQuantizer: site-level quantization, bits, storage round trip, merging per-process parts."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_huginn
from support.builders import random_quantizer

from loopvq_calib.calibration.stages import load_quantizer, save_quantizer
from loopvq_calib.codes.quantizer import KVQuantizer, merge_quantizers


def test_quantize_sites_equals_per_block_codec_on_huginn_layout():
    kv = make_tiny_huginn().kv_layout()
    q = random_quantizer(kv)
    keys = {s.site: torch.randn(2, 5, 4, 16) for s in kv.sites}
    values = {s.site: torch.randn(2, 5, 4, 16) for s in kv.sites}
    qk, qv = q.quantize_sites(keys, values)
    assert set(qk) == set(qv) == {s.site for s in kv.sites}
    codec = q.codecs["key.b0.l0"]  # core layer 0, loop steps 0-3 (sites 1, 3, 5, 7)
    x = torch.stack([keys[s].reshape(10, 4, 16) for s in codec.layout.sites], 1)
    torch.testing.assert_close(
        torch.stack([qk[s].reshape(10, 4, 16) for s in codec.layout.sites], 1), codec.quantize(x)
    )
    assert codec.layout.sites == (1, 3, 5, 7) and q.codecs["key.prelude.l0"].layout.sites == (0,)
    assert q.bits() == {"key": 0.5, "value": 0.5}


def test_save_load_round_trip(tmp_path):
    kv = make_tiny_huginn().kv_layout()
    q = random_quantizer(kv)
    save_quantizer(q, tmp_path)
    back = load_quantizer(tmp_path)
    assert back.kv == kv and list(back.codecs) == list(q.codecs)
    for key in q.codecs:
        assert torch.equal(back.codecs[key].codebook, q.codecs[key].codebook)
        assert torch.equal(back.codecs[key].layout.groups, q.codecs[key].layout.groups)


def test_merge_parts_in_layout_order():
    kv = make_tiny_huginn().kv_layout()
    q = random_quantizer(kv)
    keys = list(q.codecs)
    parts = [KVQuantizer({k: q.codecs[k] for k in keys[r::2]}, "loopvq", 16, 8, 4, "none", kv) for r in range(2)]
    merged = merge_quantizers(parts, keys)
    assert list(merged.codecs) == keys
    with pytest.raises(ValueError, match="no process fitted"):
        merge_quantizers(parts[:1], keys)
