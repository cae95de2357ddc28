"""The step tables of decode attention (serving/decode_attention.py): channel table x indices is the codec's
decode, each table switches to float32 where packed-half sums could overflow, and a layout that misses channels is
refused. CPU only, no kernel."""

from __future__ import annotations

import pytest
import torch
from support.decode import gen, make_codecs

from loopvq_calib.codes.codec import Codes
from loopvq_calib.serving import decode_attention as da


def test_step_tables_reproduce_the_codec_decode():
    """Channel table x indices = BlockCodec.decode at every step (TaSQ weight divided in, sigma apart)."""
    kc, _ = make_codecs("tasq+loopvq", 2, 16, 16, 8, 4)
    idx = torch.randint(0, 16, (5, 2, kc.layout.num_groups), generator=gen(1)).to(torch.uint8)
    sigma = torch.ones(5, 4).half()
    full = kc.decode(Codes(idx, sigma))  # [5, T, H, D]
    for step in range(4):
        table, code = da.channel_table(kc, step)
        picked = idx.long().gather(2, code[None].expand(5, -1, -1))  # [5, H, D]
        got = table[torch.arange(2)[None, :, None], picked, torch.arange(16)]
        torch.testing.assert_close(got, full[:, step], rtol=1e-6, atol=1e-6)


def test_tables_switch_to_float32_where_packed_half_sums_could_overflow():
    """A value table is float16 while VALUE_TERMS of its values sum within float16's range, a key table while
    KEY_TERMS products with a query channel of QUERY_BOUND do; beyond, that table (only) is float32."""
    fmax = torch.finfo(torch.float16).max
    value_limit, key_limit = fmax / da.VALUE_TERMS, fmax / (da.KEY_TERMS * da.QUERY_BOUND)
    for key_max, value_max, key_dtype, value_dtype in (
        (3.0, 3.0, torch.float16, torch.float16),
        (0.99 * key_limit, 0.99 * value_limit, torch.float16, torch.float16),
        (3.0, 1.01 * value_limit, torch.float16, torch.float32),
        (1.01 * key_limit, 3.0, torch.float32, torch.float16),
        (1.01 * key_limit, 1.01 * value_limit, torch.float32, torch.float32),
    ):
        kc, vc = make_codecs("loopvq", 2, 32, 16, 8, 4)
        for codec, largest in ((kc, key_max), (vc, value_max)):
            codec.codebook.data *= largest / da.channel_table(codec, 1)[0].abs().max()  # the step's largest
        tables = da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float16)
        assert (tables.key_a.dtype, tables.key_b.dtype, tables.value.dtype) == (key_dtype, key_dtype, value_dtype)
        assert torch.allclose(
            tables.value.float(),
            da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float32).value,
            rtol=1e-3,
        )
        assert (
            da.step_tables(kc, vc, 1, rope_style="half", device="cpu", dtype=torch.float32).key_a.dtype == torch.float32
        )
    assert value_limit > 4000 and 200 < key_limit < 300  # 65504 / 16 and 65504 / 256


def test_step_tables_refuse_a_layout_that_misses_channels():
    kc, vc = make_codecs("loopvq", 1, 16, 16, 8, 4)
    kc.layout.groups = kc.layout.groups.clone()
    kc.layout.groups[0, 0, 0] = kc.layout.groups[0, 0, 1]  # one coordinate twice, another never
    with pytest.raises(ValueError, match="does not cover the 16 channels exactly once"):
        da.step_tables(kc, vc, 0, rope_style="half", device="cpu")
