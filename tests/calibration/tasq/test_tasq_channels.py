"""``tasq.grouping: channels``: every key group holds the same channels at every step of its block (a fixed
per-step slice, c = G / T_c coordinates per step), fitted with the same det cost as the free grouping."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from support.builders import tiny_config

from loopvq_calib.bundle.reader import load_bundle
from loopvq_calib.calibration.fingerprints import RunFacts, fingerprint, stage_fingerprints
from loopvq_calib.calibration.tasq.grouping import channel_units, fit_groups, fit_tasq, rope_pair_units
from loopvq_calib.cli import calibrate_main
from loopvq_calib.codes.layouts import plan_layouts
from loopvq_calib.config.load import load_config
from loopvq_calib.config.schema import QuantConfig, TasqConfig
from loopvq_calib.config.source import ConfigError
from loopvq_calib.version import __version__


def quant(group_size: int = 8) -> QuantConfig:
    return QuantConfig(method="tasq+loopvq", group_size=group_size, codebook_size=16, bits=None, steps_per_block=4)


def per_step_channels(group: list[int], head_dim: int, steps: int) -> list[list[int]]:
    """The channels of each step that one group (flat coordinates m * D + channel) covers."""
    return [sorted(c % head_dim for c in group if c // head_dim == m) for m in range(steps)]


def test_channel_units_are_one_rope_pair_at_every_step():
    assert channel_units(4, 2, "half").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert channel_units(4, 2, "interleaved").tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert channel_units(8, 1, "half").tolist() == rope_pair_units(8, 1, "half").tolist()  # one step: the same units


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_fitted_groups_hold_the_same_channels_at_every_step(style):
    d, steps, g = 16, 4, 16
    x = torch.randn(4000, steps * d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    groups = fit_groups(x.T @ x / len(x), channel_units(d, steps, style), g, eps=1e-6)
    assert groups.shape == (steps * d // g, g)
    assert sorted(groups.flatten().tolist()) == list(range(steps * d))  # a partition of the block
    for group in groups.tolist():
        channels = per_step_channels(group, d, steps)
        assert all(len(c) == g // steps for c in channels) and all(c == channels[0] for c in channels)
        pairs = {frozenset(p) for p in channel_units(d, 1, style).tolist()}
        assert all(any(set(p) <= set(channels[0]) for p in pairs if ch in p) for ch in channels[0])  # whole pairs


def test_planted_channels_correlated_across_steps_are_grouped():
    """Channels 0, 8 (a half-style pair) and 3, 11 move together at every step: the fit puts them in one group."""
    d, steps = 16, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6000, steps * d, generator=gen, dtype=torch.float64)
    shared = torch.randn(6000, 1, generator=gen, dtype=torch.float64) * 3
    for m in range(steps):
        for ch in (0, 8, 3, 11):
            x[:, m * d + ch] += shared[:, 0]
    groups = fit_groups(x.T @ x / len(x), channel_units(d, steps, "half"), 8, eps=1e-6)
    together = [g for g in groups.tolist() if 0 in g]
    assert per_step_channels(together[0], d, steps)[0] == [0, 3, 8, 11]


def test_fit_tasq_with_channels_gives_a_fixed_per_step_slice(tiny_captures):
    _, kv, _, reader = tiny_captures["ouro"]
    layouts = plan_layouts(kv, quant())
    result = fit_tasq(reader, layouts, kv, quant=quant(), cfg=TasqConfig(grouping="channels"))
    assert result.report["grouping"] == "channels"
    for lay in result.layouts:
        if lay.kind != "key":
            continue
        for head in lay.groups.tolist():
            for group in head:
                channels = per_step_channels(group, lay.head_dim, lay.steps)
                assert all(c == channels[0] and len(c) == 2 for c in channels)  # c = 8 / 4 at every step


def test_channels_group_size_must_be_reachable_and_the_choice_known(
    tiny_captures, tiny_ouro_dir, calib_corpus, tmp_path
):
    _, kv, _, reader = tiny_captures["ouro"]
    with pytest.raises(
        ConfigError,
        match=r"quant.group_size: .*RoPE pairs taken at every step \(8 coordinates\).*"
        r"group_size 4 is not reachable",
    ):
        fit_tasq(reader, plan_layouts(kv, quant(4)), kv, quant=quant(4), cfg=TasqConfig(grouping="channels"))
    raw = tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", tasq={"grouping": "rows"})
    with pytest.raises(ConfigError, match="tasq.grouping"):
        load_config(raw)


def test_the_free_grouping_keeps_the_fingerprints_of_earlier_runs(tiny_ouro_dir, calib_corpus, tmp_path):
    cfg = load_config(tiny_config(tiny_ouro_dir, calib_corpus, tmp_path / "run", quant={"method": "tasq+loopvq"}))
    facts = RunFacts(model_identity={"model": "m"}, loop_steps=4, tokenizer_files="tokenizer", data_sources=[])
    free = stage_fingerprints(cfg, facts)
    t = cfg.tasq  # the settings a run made before the option fingerprinted
    before = fingerprint(
        "tasq",
        __version__,
        free["capture"],
        dataclasses.asdict(cfg.quant),
        {"det_eps": t.det_eps, "sigma_min": t.sigma_min, "weight_floor": t.weight_floor},
    )
    channels = stage_fingerprints(dataclasses.replace(cfg, tasq=TasqConfig(grouping="channels")), facts)
    assert free["tasq"] == before and channels["tasq"] != before and channels["capture"] == free["capture"]


def test_a_channels_bundle_is_calibrated_read_and_decoded_like_any_tasq_bundle(tiny_ouro_dir, calib_corpus, tmp_path):
    raw = tiny_config(
        tiny_ouro_dir,
        calib_corpus,
        tmp_path / "run",
        quant={"method": "tasq+loopvq", "bits": None},
        tasq={"grouping": "channels"},
        finetune={"enabled": False},
    )
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(raw))
    assert calibrate_main(["--config", str(cfg_file)]) == 0
    bundle = load_bundle(tmp_path / "run" / "bundle", model=tiny_ouro_dir)
    q = bundle.quantizer
    keys = [c.layout for c in q.codecs.values() if c.layout.kind == "key"]
    assert keys and all(lay.group_size == 8 for lay in keys)
    for lay in keys:
        for head in lay.groups.tolist():
            assert all(len(set(map(tuple, per_step_channels(g, lay.head_dim, lay.steps)))) == 1 for g in head)
    assert json.loads((tmp_path / "run" / "tasq" / "tasq.json").read_text())["report"]["grouping"] == "channels"
    gen = torch.Generator().manual_seed(3)
    sites = [s.site for s in q.kv.sites]
    x = {s: torch.randn(1, 5, q.kv.kv_heads, q.kv.head_dim, generator=gen) for s in sites}
    k, v = q.quantize_sites(x, x)
    assert all(k[s].shape == x[s].shape and torch.isfinite(k[s]).all() and not torch.equal(k[s], x[s]) for s in sites)
