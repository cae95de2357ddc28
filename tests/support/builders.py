"""Small builders shared by several test modules: a pipeline config of the tiny models, a random quantizer, k-means
blobs and a NumPy nearest-centroid reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from loopvq_calib.codes.codec import BlockCodec
from loopvq_calib.codes.layouts import codebook_shape, plan_layouts
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import Config, QuantConfig
from loopvq_calib.config.validate import validate

CPU = torch.device("cpu")


def np_assign(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Brute-force nearest centroid, float64: x [N, G], c [K, G] -> [N]."""
    return ((x[:, None, :] - c[None]) ** 2).sum(-1).argmin(-1)


def blobs(p: int, n: int, g: int, k: int, seed: int, spread: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    """P problems of N points around k Gaussian centres, with random positive weights."""
    rng = torch.Generator().manual_seed(seed)
    centres = torch.randn(p, k, g, generator=rng) * 3
    label = torch.randint(0, k, (p, n), generator=rng)
    x = centres.gather(1, label[..., None].expand(-1, -1, g)) + spread * torch.randn(p, n, g, generator=rng)
    return x, torch.rand(p, n, generator=rng) + 0.05


def random_quantizer(kv, method="loopvq", seed=0) -> KVQuantizer:
    quant = QuantConfig(method=method, group_size=8, codebook_size=16, bits=None)
    gen = torch.Generator().manual_seed(seed)
    codecs = {
        lay.key: BlockCodec(lay, torch.randn(codebook_shape(lay, 16, "none"), generator=gen))
        for lay in plan_layouts(kv, quant)
    }
    return KVQuantizer(codecs, method, 16, 8, quant.block_steps, "none", kv)


def tiny_config(model_dir: Path, corpus: Path, out: Path, **sections) -> dict:
    cfg = {
        "model": {"name_or_path": str(model_dir)},
        "data": {
            "dataset": str(corpus),
            "num_sequences": 6,
            "sequence_length": 32,
            "heldout_sequences": 2,
            "sink_tokens": 4,
        },
        "quant": {"method": "loopvq", "codebook_size": 16, "group_size": 8, "bits": 0.5},
        # reusable, and the same for every method (fisher_channels null would follow the method's G / T_c)
        "capture": {"store": "disk", "fisher_channels": 1},
        "kmeans": {"iterations": 8, "backend": "torch"},
        "finetune": {"epochs": 2, "lr": 1e-2},
        "output": {"dir": str(out), "serving": {"sink_tokens": 8, "recent_window": 16}},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def tiny_run_config(method: str = "loopvq") -> Config:
    """A validated Config of ``method`` with small stage settings (16 codewords of 8 coordinates, 5 torch k-means
    updates)."""
    cfg = Config()
    cfg.quant.method = method
    cfg.quant.codebook_size, cfg.quant.group_size, cfg.quant.bits = 16, 8, 0.5
    cfg.capture.dtype, cfg.capture.fisher_channels = "float32", 2
    cfg.kmeans.iterations, cfg.kmeans.backend = 5, "torch"
    return validate(cfg)
