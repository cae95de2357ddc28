"""The reference encoder / decoder and the group layouts, on hand-made data."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.codes.codec import (
    BlockCodec,
    Codes,
    TasqTransform,
    code_bits,
    gather_groups,
    nearest,
    scatter_groups,
    sigma_bits,
)
from loopvq_calib.codes.layouts import BlockLayout, channel_groups, codebook_shape, loop_axis_groups, plan_layouts
from loopvq_calib.config.schema import QuantConfig
from loopvq_calib.models.sites import KVLayout, KVSite


def test_cq_groups_are_consecutive_channels():
    assert channel_groups(8, 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="not divisible"):
        channel_groups(8, 3)


def test_loop_axis_coordinate_order_is_channel_major_step_minor():
    """Ouro-1.4B at 0.5 bit: D 128, T_c 4, G 16 -> c 4 channels per step, 32 joint groups; joint coordinate
    i*T_c + m holds channel g*c + i of step m (flat m*D + channel)."""
    g = loop_axis_groups(128, 4, 16)
    assert g.shape == (32, 16)
    group, i, m = 5, 2, 3
    assert g[group, i * 4 + m].item() == m * 128 + group * 4 + i
    assert sorted(g.flatten().tolist()) == list(range(512))


def test_plan_layouts_blocks_and_codebook_shapes():
    sites = tuple(KVSite(t * 2 + l, t, l, True, "loop") for t in range(4) for l in range(2))
    kv = KVLayout("ouro", sites, 4, 3, 8, "half", 1e4)
    loop = plan_layouts(kv, QuantConfig(method="loopvq", group_size=8, codebook_size=16, bits=None))
    assert [(x.key, x.sites) for x in loop] == [
        ("key.b0.l0", (0, 2, 4, 6)),
        ("value.b0.l0", (0, 2, 4, 6)),
        ("key.b0.l1", (1, 3, 5, 7)),
        ("value.b0.l1", (1, 3, 5, 7)),
    ]
    cq = plan_layouts(kv, QuantConfig(method="cq", group_size=8, codebook_size=16, bits=None))
    assert len(cq) == 16 and all(x.steps == 1 for x in cq)
    for lay in loop + cq:
        lay.check()
    assert codebook_shape(loop[0], 16, "none") == (3, 4, 16, 8)
    assert codebook_shape(loop[0], 16, "heads") == (1, 4, 16, 8)
    assert codebook_shape(loop[0], 16, "all") == (1, 1, 16, 8)


def test_gather_and_scatter_are_inverse_permutations():
    x = torch.randn(5, 4, 3, 8)
    groups = loop_axis_groups(8, 4, 8)[None]
    z = gather_groups(x, groups)
    assert z.shape == (5, 3, 4, 8)
    assert torch.equal(z[:, :, 1, 6], x[:, 2, :, 3])  # group 1, i = 1, m = 2 -> channel 1*2+1 of step 2
    assert torch.equal(scatter_groups(z, groups, 4), x)


def test_nearest_and_decode_on_hand_made_codebook():
    """2 heads, one group of G 2 per head, K 3 codewords; the expected indices are worked out by hand."""
    layout = BlockLayout("x", "value", (0,), head_dim=2, kv_heads=2, groups=torch.tensor([[[0, 1]]]))
    codebook = torch.tensor([[[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]]], [[[5.0, 5.0], [-1.0, -1.0], [3.0, 0.0]]]])
    x = torch.tensor([[[[0.9, 0.1], [2.0, 1.0]]], [[[0.1, 1.5], [-2.0, 0.0]]]])  # [N=2, T=1, H=2, D=2]
    codec = BlockCodec(layout, codebook)
    codes = codec.encode(x)
    assert codes.indices.dtype == torch.uint8
    assert codes.indices[..., 0].tolist() == [[1, 2], [2, 1]]
    decoded = codec.decode(codes)
    assert decoded[0, 0].tolist() == [[1.0, 0.0], [3.0, 0.0]] and decoded[1, 0].tolist() == [[0.0, 2.0], [-1.0, -1.0]]


def test_nearest_matches_brute_force_and_shared_codebooks_broadcast():
    z = torch.randn(50, 3, 4, 8)
    for cb in (torch.randn(3, 4, 16, 8), torch.randn(1, 4, 16, 8), torch.randn(1, 1, 16, 8)):
        full = cb.expand(3, 4, -1, -1)
        brute = ((z[:, :, :, None] - full[None]) ** 2).sum(-1).argmin(-1)
        assert torch.equal(nearest(z, cb, chunk=7), brute)


def test_codec_moves_coordinates_as_gather_and_scatter_groups_with_per_head_groups():
    """BlockCodec gathers group vectors straight from [N, T, H, D] with a permutation kept per groups tensor;
    it must give exactly gather_groups / nearest / scatter_groups, also for per-head groups (TaSQ)."""
    gen = torch.Generator().manual_seed(0)
    groups = torch.stack([torch.randperm(3 * 8, generator=gen) for _ in range(2)]).view(2, 6, 4)
    layout = BlockLayout("b0.l0", "key", (0, 1, 2), head_dim=8, kv_heads=2, groups=groups)
    codec = BlockCodec(layout, torch.randn(2, 6, 16, 4, generator=gen))
    x = torch.randn(9, 3, 2, 8, generator=gen)
    want = nearest(gather_groups(x, groups), codec.codebook)
    codes = codec.encode(x)
    assert torch.equal(codes.indices.long(), want)
    z = codec.codebook.reshape(-1, 4)[(torch.arange(2)[:, None] * 6 + torch.arange(6)) * 16 + want]  # [N, H, n, G]
    assert torch.equal(codec.decode(codes), scatter_groups(z, groups, 3))
    layout.groups = groups.flip(-1)  # a new groups tensor: the kept permutation is recomputed
    assert torch.equal(codec.encode(x).indices.long(), nearest(gather_groups(x, layout.groups), codec.codebook))
    layout.groups = groups[:, :5]  # 20 of a head's 24 coordinates
    with pytest.raises(ValueError, match="groups cover 20 of the 24 coordinates"):
        codec.encode(x)


def test_nearest_distances_stay_fp32_under_autocast():
    """Autocast would run the distance product in bf16; the assignment must be the fp32 one."""
    gen = torch.Generator().manual_seed(0)
    z, cb = torch.randn(400, 2, 3, 16, generator=gen), torch.randn(2, 3, 64, 16, generator=gen)
    want = nearest(z, cb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(nearest(z, cb), want)


def test_lookup_gradient_reaches_only_used_codewords():
    layout = BlockLayout("b0.l0", "key", (0, 1), head_dim=4, kv_heads=1, groups=loop_axis_groups(4, 2, 4)[None])
    cb = torch.randn(1, 2, 8, 4, requires_grad=True)
    codec = BlockCodec(layout, cb)
    y = codec.decode(Codes(torch.tensor([[[3, 5]]], dtype=torch.uint8)))
    y.sum().backward()
    used = torch.zeros(1, 2, 8, dtype=torch.bool)
    used[0, 0, 3] = used[0, 1, 5] = True
    assert (cb.grad[used] == 1).all() and (cb.grad[~used] == 0).all()


def test_tasq_sigma_rule_and_exact_inverse():
    w = torch.rand(2, 3, 8) + 0.5
    t = TasqTransform(w, sigma_min=1e-4)
    x = torch.randn(6, 2, 3, 8)
    sigma = t.sigma(x)
    expected = ((x * w) ** 2).mean(dim=(-1, -2)).sqrt().clamp_min(1e-4).half()
    assert sigma.dtype == torch.float16 and torch.equal(sigma, expected)
    torch.testing.assert_close(t.inverse(t.forward(x, sigma), sigma), x)
    assert t.sigma(torch.zeros(1, 2, 3, 8)).float().tolist() == [[pytest.approx(1e-4, rel=1e-3)] * 2]


def test_bits_accounting():
    assert code_bits(256, 16) == 0.5 and code_bits(256, 32) == 0.25
    assert code_bits(256, 16) + sigma_bits(16, 128) == pytest.approx(0.5078125)
    assert code_bits(256, 16) + sigma_bits(55, 96) == pytest.approx(0.503, abs=1e-3)


def test_pack_indices_bit_order_by_hand():
    """LSB-first bit stream, indices straddling bytes, last byte zero-padded (bundle-format section 8)."""
    from loopvq_calib.codes.packing import pack_indices, unpack_indices

    assert pack_indices(torch.tensor([1, 2, 15]), 4).tolist() == [0x21, 0x0F]
    assert pack_indices(torch.tensor([5, 3, 7]), 3).tolist() == [0b11011101, 0b1]  # 101 | 011 | 111, LSB first
    assert pack_indices(torch.tensor([[300, 1]]), 9).tolist() == [[300 & 0xFF, (300 >> 8) | (1 << 1), 0]]
    assert unpack_indices(torch.tensor([0x21, 0x0F], dtype=torch.uint8), 4, 3).tolist() == [1, 2, 15]


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 6, 8, 12, 16])
def test_pack_indices_round_trip(bits):
    from loopvq_calib.codes.packing import index_bits, pack_indices, unpack_indices

    x = torch.randint(0, 1 << bits, (3, 4, 33), generator=torch.Generator().manual_seed(bits))
    packed = pack_indices(x, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, -(-33 * bits // 8))
    assert torch.equal(unpack_indices(packed, bits, 33), x)
    assert index_bits(1 << bits) == bits


def test_pack_indices_refuses_out_of_range():
    from loopvq_calib.codes.packing import pack_indices, unpack_indices

    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        pack_indices(torch.tensor([16]), 4)
    with pytest.raises(ValueError, match="1..16"):
        pack_indices(torch.tensor([1]), 17)
    with pytest.raises(ValueError, match="fewer than 5 indices"):
        unpack_indices(torch.zeros(2, dtype=torch.uint8), 4, 5)


def test_indices_entries_store_the_forms_of_format_1_1_and_read_back():
    """K < 256: plain uint8 and/or packed (4 bits at K 16: 3 indices in 2 bytes); K 256: plain only; K 300: int32."""
    from loopvq_calib.codes.packing import indices_entries, read_indices

    x = torch.tensor([[1, 2, 15], [0, 7, 9]])
    both = indices_entries("key.b0", x, 16)
    assert both["key.b0.indices"].dtype == torch.uint8 and both["key.b0.indices"].tolist() == x.tolist()
    assert both["key.b0.indices_packed"].tolist() == [[0x21, 0x0F], [0x70, 0x09]]
    packed = indices_entries("key.b0", x, 16, form="packed")
    assert list(packed) == ["key.b0.indices_packed"]
    assert torch.equal(read_indices(packed, "key.b0", 16, count=3), x) and torch.equal(
        read_indices(both, "key.b0", 16, count=3), x
    )
    assert list(indices_entries("v", x, 256, form="packed")) == ["v.indices"]
    wide = indices_entries("v", torch.tensor([[299, 0, 5]]), 300)
    assert list(wide) == ["v.indices"] and wide["v.indices"].dtype == torch.int32


def test_read_indices_names_the_tensor_it_refuses():
    from loopvq_calib.codes.packing import indices_entries, read_indices

    x = torch.tensor([[1, 2, 15]])
    both = indices_entries("key.b0", x, 16)
    with pytest.raises(ValueError, match=r"key.b0.indices_packed: expected uint8 with 3 bytes per row"):
        read_indices(both, "key.b0", 16, count=5)
    both["key.b0.indices"] = torch.tensor([[1, 2, 14]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="key.b0.indices and key.b0.indices_packed disagree"):
        read_indices(both, "key.b0", 16, count=3)
    with pytest.raises(KeyError, match="no tensor value.b0.indices"):
        read_indices(both, "value.b0", 16, count=3)
    with pytest.raises(ValueError, match="form 'bits'"):
        indices_entries("key.b0", x, 16, form="bits")


def test_a_transform_on_its_weights_device_is_itself():
    t = TasqTransform(torch.rand(2, 3, 8) + 0.5, sigma_min=0.25)
    assert t.on(torch.device("cpu")) is t


@pytest.mark.gpu
def test_a_transform_moved_to_the_gpu_is_a_copy_with_the_same_values():
    t = TasqTransform(torch.rand(2, 3, 8) + 0.5, sigma_min=0.25)
    moved = t.on(torch.device("cuda", 0))
    assert moved is not t and moved.sigma_min == 0.25 and torch.equal(moved.weight.cpu(), t.weight)
    assert t.weight.device.type == "cpu"  # the original keeps its weights
