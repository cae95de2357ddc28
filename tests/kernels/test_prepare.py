"""Preparing the codec's kernels ahead of fine-tuning (kernels/prepare.py): on CUDA the probes run once, under the
keys the first encode and decode then find; elsewhere nothing is considered."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.codes.codec import BlockCodec
from loopvq_calib.codes.layouts import BlockLayout, loop_axis_groups
from loopvq_calib.kernels import backends, lookup, nearest
from loopvq_calib.kernels.prepare import prepare_codec_kernels


def test_nothing_is_prepared_off_cuda():
    assert prepare_codec_kernels("cpu", k=16, g=16) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_prepared_probes_are_the_ones_the_codec_finds(monkeypatch):
    """Prepared on ``cuda`` (no index), each kernel is probed once; a codec's encode and decode on cuda tensors
    then run the kernels without probing again."""
    backends.DISPATCH.clear()
    probes = []
    for module in (nearest, lookup):
        real = module.probe
        monkeypatch.setattr(
            module, "probe", lambda *args, _real=real, _name=module.__name__: probes.append(_name) or _real(*args)
        )
    try:
        assert prepare_codec_kernels(torch.device("cuda"), k=16, g=16) == {nearest.LABEL: "", lookup.LABEL: ""}
        assert sorted(probes) == ["loopvq_calib.kernels.lookup", "loopvq_calib.kernels.nearest"]
        layout = BlockLayout("b", "key", (0, 1), 16, 2, loop_axis_groups(16, 2, 16)[None])
        codec = BlockCodec(layout, torch.randn(2, 2, 16, 16, device="cuda"))
        x = torch.randn(10, 2, 2, 16, device="cuda")
        y = codec.decode(codec.encode(x))
        assert y.shape == x.shape and len(probes) == 2
    finally:
        backends.DISPATCH.clear()
