"""A crude quantizer without k-means, for measurements that need codes but no calibrated bundle (byte counts,
smoke runs) and for the tests (tests/support/quantizers.py loads it from here)."""

from __future__ import annotations

import torch

from loopvq_calib.codes.codec import BlockCodec, TasqTransform, gather_groups
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.codes.objective import teacher
from loopvq_calib.codes.quantizer import KVQuantizer
from loopvq_calib.config.schema import QuantConfig


@torch.no_grad()
def sampled_quantizer(
    model: torch.nn.Module,
    ids: torch.Tensor,
    method: str = "loopvq",
    *,
    codebook_size: int = 16,
    group_size: int = 16,
    steps_per_block: int = 4,
    seed: int = 0,
) -> KVQuantizer:
    """Each codebook's entries are random group vectors of one full-precision forward over ``ids``.

    Layouts are :func:`~loopvq_calib.codes.layouts.plan_layouts`' (no codebook sharing); TaSQ methods get unit
    channel weights. With ``codebook_size`` >= the number of tokens every group vector of ``ids`` is a
    codeword, so keys and values are reproduced exactly (non-TaSQ methods).
    """
    quant = QuantConfig(
        method=method, bits=None, codebook_size=codebook_size, group_size=group_size, steps_per_block=steps_per_block
    )
    kv = model.kv_layout()
    fp = teacher(model, ids)
    gen = torch.Generator().manual_seed(seed)
    codecs = {}
    for layout in plan_layouts(kv, quant):
        src = fp.keys if layout.kind == "key" else fp.values
        x = torch.stack([src[s].flatten(0, 1) for s in layout.sites], dim=1).float()  # [N, T, H, D]
        transform = None
        if quant.uses_tasq and layout.kind == "key":
            transform = TasqTransform(torch.ones(x.shape[1:], device=x.device))
            x = transform.forward(x, transform.sigma(x))
        z = gather_groups(x, layout.groups)  # [N, H, n, G]
        n = z.shape[0]
        rows = torch.randperm(n, generator=gen)[:codebook_size]
        if codebook_size > n:
            rows = torch.cat([rows, torch.randint(n, (codebook_size - n,), generator=gen)])
        codecs[layout.key] = BlockCodec(layout, z[rows.to(z.device)].permute(1, 2, 0, 3).contiguous(), transform)
    return KVQuantizer(codecs, method, codebook_size, group_size, quant.block_steps, "none", kv)
