"""Shared by the k-means tests (tests/calibration/kmeans/): codebook and group sizes, seeded generators, the faiss
mark, and the stage's inputs: a real tiny capture (a module fixture), quantization configs and TaSQ transforms."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_ouro

from loopvq_calib.calibration.capture.kv import capture_kv, write_meta
from loopvq_calib.calibration.capture.reader import CaptureReader
from loopvq_calib.codes.codec import TasqTransform
from loopvq_calib.codes.layouts import BlockLayout
from loopvq_calib.config.schema import CaptureConfig, Config, KMeansConfig, QuantConfig
from loopvq_calib.config.validate import validate
from loopvq_calib.data.corpus import CalibrationSet
from loopvq_calib.models.sites import KVLayout

K, G = 16, 8

SINKS = 4

needs_faiss = pytest.mark.skipif(importlib.util.find_spec("faiss") is None, reason="faiss is not installed")

FAST = KMeansConfig(iterations=25, backend="torch")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def tiny_capture(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaptureReader, KVLayout]:
    """4 sequences x 32 tokens of a tiny Ouro (2 layers x 4 loops, 4 KV heads of 16): 112 tokens after sinks."""
    model = make_tiny_ouro()
    kv = model.kv_layout()
    ids = torch.randint(0, 4096, (4, 32), generator=gen(0))
    calib = CalibrationSet(input_ids=ids, train=[0, 1, 2], heldout=[3], sink_tokens=SINKS)
    out: Path = tmp_path_factory.mktemp("capture")
    cap = CaptureConfig(dtype="float32")
    capture_kv(model, calib, kv, cfg=cap, out=out)
    write_meta(out, calib, kv, cfg=cap)
    return CaptureReader(out), kv


def quant_config(method: str = "loopvq", sharing: str = "none", codebook_size: int = K) -> QuantConfig:
    cfg = Config()
    cfg.quant = QuantConfig(
        method=method, bits=None, codebook_size=codebook_size, group_size=G, codebook_sharing=sharing
    )
    cfg.finetune.enabled = False
    return validate(cfg).quant


def tasq_transforms(layouts: list[BlockLayout], kv: KVLayout) -> dict[str, TasqTransform]:
    out = {}
    for i, lay in enumerate(layouts):
        if lay.kind == "key":
            w = torch.rand(lay.steps, kv.kv_heads, kv.head_dim, generator=gen(i)) + 0.5
            out[lay.key] = TasqTransform(w / w.pow(2).mean(-1, keepdim=True).sqrt())
    return out
