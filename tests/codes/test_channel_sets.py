"""``channel_sets`` (codes/layouts.py): the one test of a channels layout (each code the same channels, whole RoPE
pairs, at every step of its block), on the TaSQ stage's own groupings and on layouts that miss one condition."""

from __future__ import annotations

import pytest
import torch

from loopvq_calib.calibration.tasq.grouping import channel_units, fit_groups, rope_pair_units
from loopvq_calib.codes.layouts import BlockLayout, channel_groups, channel_sets, loop_axis_groups


def layout(groups: torch.Tensor, steps: int, d: int) -> BlockLayout:
    return BlockLayout("b0.l0", "key", tuple(range(steps)), d, groups.shape[0], groups)


def covariance(steps: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(3000, steps * d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.T @ x / len(x)


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_the_tasq_stages_channels_grouping_is_detected_and_its_free_grouping_is_not(style):
    d, steps, g = 16, 4, 16
    fitted = fit_groups(covariance(steps, d, 0), channel_units(d, steps, style), g, eps=1e-6)
    sets = channel_sets(layout(fitted[None], steps, d), style)
    assert sets is not None and sets.shape == (1, steps * d // g, g // steps)
    for group, channels in zip(fitted.tolist(), sets[0].tolist()):  # the channels of step 0, found directly
        assert channels == sorted(c for c in group if c < d)
    free = fit_groups(covariance(steps, d, 1), rope_pair_units(d, steps, style), g, eps=1e-6)
    assert channel_sets(layout(free[None], steps, d), style) is None


def test_loop_axis_groups_are_whole_pairs_only_with_interleaved_rope():
    """Loop-axis code g holds channels g*c .. g*c + c - 1 at every step: pairs (2i, 2i+1) when c is even,
    never the half-split pairs (i, i + D/2)."""
    groups = loop_axis_groups(16, 4, 16)[None]
    assert channel_sets(layout(groups, 4, 16), "half") is None
    assert channel_sets(layout(groups, 4, 16), "interleaved")[0].tolist() == [
        [4 * g + i for i in range(4)] for g in range(4)
    ]
    assert channel_sets(layout(channel_groups(16, 8)[None], 1, 16), "interleaved") is not None  # one step


def test_a_code_that_changes_channels_between_steps_or_splits_a_pair_is_no_channels_layout():
    d, steps = 8, 2
    good = torch.tensor([[[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]])  # half pairs, both steps
    assert channel_sets(layout(good, steps, d), "half").tolist() == [[[0, 4], [1, 5], [2, 6], [3, 7]]]
    moved = good.clone()
    moved[0, 0, 2], moved[0, 1, 2] = 9, 8  # step 1 of codes 0 and 1 swap channels 0 and 1
    assert channel_sets(layout(moved, steps, d), "half") is None
    assert channel_sets(layout(good, steps, d), "interleaved") is None  # (0, 4) is no interleaved pair
    uneven = torch.tensor([[[0, 4, 1, 5], [8, 12, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]])  # code 0: step 0 only
    assert channel_sets(layout(uneven, steps, d), "half") is None
    assert channel_sets(layout(torch.arange(24).view(1, 3, 8), 3, 8), "half") is None  # G = 8 over 3 steps
