"""Config loading and validation: every bad input fails with the key path and what is allowed."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from loopvq_calib.cli import calibrate_main
from loopvq_calib.config.load import dump_config, load_config, resolve_derived
from loopvq_calib.config.schema import Config
from loopvq_calib.config.source import ConfigError
from loopvq_calib.config.validate import validate, validate_for_model

BAD = [
    ({"quant": {"method": "vq"}}, "quant.method", "'vq' is not allowed; choose one of cq, tasq, loopvq, tasq+loopvq"),
    ({"quant": {"bogus": 1}}, "quant.bogus", "unknown key; allowed here:"),
    ({"bogus": {}}, "bogus", "unknown key; allowed here: capture, data, finetune"),
    ({"quant": {"group_size": "16"}}, "quant.group_size", "expected int, got str"),
    ({"quant": {"group_size": 12}}, "quant.bits", "does not match log2(codebook_size)/group_size = log2(256)/12"),
    ({"quant": {"group_size": 18, "bits": None}}, "quant.group_size", "not divisible by steps_per_block 4"),
    ({"quant": {"codebook_size": 100, "bits": None}}, "quant.codebook_size", "power of two"),
    ({"quant": {"method": "tasq+loopvq", "group_size": 4, "bits": None}}, "quant.group_size", "must be even"),
    (
        {"data": {"num_sequences": 4, "heldout_sequences": 4}},
        "data.heldout_sequences",
        "0 < heldout_sequences < num_sequences",
    ),
    ({"data": {"sink_tokens": 512}}, "data.sink_tokens", "leave no token"),
    ({"data": {"type": "csv"}}, "data.type", "choose one of auto, hub, text, json, jsonl, parquet"),
    ({"model": {"dtype": "fp8"}}, "model.dtype", "choose one of float32, bfloat16, float16"),
    ({"model": {"device": "tpu"}}, "model.device", "use auto, cpu, cuda or cuda:N"),
    ({"kmeans": {"backend": "sklearn"}}, "kmeans.backend", "choose one of auto, faiss, torch"),
    ({"finetune": {"lr": -1}}, "finetune.lr", "must be > 0"),
    ({"output": {"serving": {"recent_window": 60}}}, "output.serving.recent_window", "not a multiple of page_size 8"),
    ({"quant": []}, "quant", "expected a mapping, got list"),
    ({"capture": {"store": "ram"}}, "capture.store", "choose one of auto, device, memory, disk"),
    ({"capture": {"fisher_channels": 8}}, "capture.fisher_channels", "does not divide the 4 channels per step"),
    (
        {"quant": {"method": "tasq"}, "capture": {"fisher_channels": 32}},
        "capture.fisher_channels",
        "does not divide the 16 channels per step",
    ),
    ({"kmeans": {"device": "gpu"}}, "kmeans.device", "use auto, cpu, cuda or cuda:N"),
    ({"finetune": {"cache_teacher": "maybe"}}, "finetune.cache_teacher", "choose one of auto, true, false"),
    (
        {"finetune": {"loop_checkpointing": "sometimes"}},
        "finetune.loop_checkpointing",
        "choose one of true, false, auto",
    ),
    ({"finetune": {"loop_checkpointing": 1}}, "finetune.loop_checkpointing", "expected bool, got int"),
]


@pytest.mark.parametrize("raw,path,message", BAD, ids=[b[1] for b in BAD])
def test_bad_configs_name_key_path_and_allowed_values(raw, path, message):
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert err.value.path == path
    assert message in str(err.value)
    assert str(err.value).startswith(path + ":")


@pytest.mark.parametrize(
    "head_dim,steps,method,group,path,message",
    [
        (64, 4, "loopvq", 24, "quant.group_size", "head_dim 64 is not divisible by c = G / T_c = 6"),
        (64, 6, "loopvq", 16, "quant.steps_per_block", "6 loop steps cannot be split into blocks of 4"),
        (96, 32, "cq", 64, "quant.group_size", "head_dim 96 is not divisible by group_size = 64"),
    ],
)
def test_model_dependent_combinations(head_dim, steps, method, group, path, message):
    cfg = load_config({"quant": {"method": method, "group_size": group, "bits": None}})
    with pytest.raises(ConfigError) as err:
        validate_for_model(cfg, head_dim=head_dim, kv_heads=4, loop_steps=steps, has_prelude=False)
    assert err.value.path == path and message in str(err.value)


def test_defaults_derive_bits_and_serving_sinks():
    cfg = load_config({"quant": {"group_size": 32, "bits": None}, "data": {"sink_tokens": 16}})
    assert cfg.quant.bits == 0.25
    assert cfg.output.serving.sink_tokens == 16
    assert cfg.quant.block_steps == 4 and load_config({"quant": {"method": "cq"}}).quant.block_steps == 1


def test_overrides_and_round_trip(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"quant": {"method": "cq"}}))
    cfg = load_config(path, ["quant.group_size=32", "quant.bits=0.25", "kmeans.tolerance=1e-4", "output.dir=x"])
    assert (cfg.quant.group_size, cfg.quant.bits, cfg.kmeans.tolerance, cfg.output.dir) == (
        32,
        0.25,
        1e-4,
        str(Path.cwd() / "x"),
    )
    again = load_config(yaml.safe_load(dump_config(cfg)))
    assert again == cfg
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(path, ["quant.group_size"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_booleans_for_true_false_choices_and_a_non_mapping_config(tmp_path):
    assert load_config({"finetune": {"cache_teacher": True}}).finetune.cache_teacher == "true"
    assert load_config({}, ["finetune.cache_teacher=false"]).finetune.cache_teacher == "false"
    for raw, value in ((True, True), (False, False), ("auto", "auto")):  # booleans stay booleans (fingerprints)
        got = load_config({"finetune": {"loop_checkpointing": raw}}).finetune.loop_checkpointing
        assert got == value and type(got) is type(value)
    assert load_config({}, ["finetune.loop_checkpointing=auto"]).finetune.loop_checkpointing == "auto"
    assert load_config({}, ["finetune.loop_checkpointing=true"]).finetune.loop_checkpointing is True
    assert load_config({}).finetune.loop_checkpointing is False
    listed = tmp_path / "list.yaml"
    listed.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match="top level of the config must be a mapping of sections, got list"):
        load_config(listed)


def test_every_config_key_is_documented():
    """docs/config.md has a table row for every key of the config tree, under its section."""
    text = (ROOT / "docs" / "config.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M))

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
                yield from keys(f.default_factory, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    missing = [
        f"{sec.name}.{k}"
        for sec in dataclasses.fields(Config)
        for k in keys(sec.default_factory)
        if f"| `{k}` |" not in sections.get(sec.name, "")
    ]
    assert not missing, f"undocumented config keys: {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    if "tiny" not in path.name:
        assert cfg.model.name_or_path.count("/") == 1  # hub ids
        assert cfg.data.num_sequences == 16 and cfg.data.sequence_length == 2048


def test_cli_exits_2_with_the_key_path_before_any_work(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"quant": {"group_size": 12}, "output": {"dir": str(tmp_path / "run")}}))
    assert calibrate_main(["--config", str(bad)]) == 2
    assert "config error: quant.bits:" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_validate_never_changes_the_config():
    """Derived values are filled by the loader (resolve_derived) only; validate is a pure check."""

    cfg = Config()
    cfg.quant.bits, cfg.quant.group_size, cfg.output.serving.sink_tokens = None, 32, None
    before = copy.deepcopy(cfg)
    assert validate(cfg) is cfg and cfg == before
    resolve_derived(cfg)
    assert cfg.quant.bits == 0.25 and cfg.output.serving.sink_tokens == cfg.data.sink_tokens == 8


@pytest.mark.parametrize(
    "override,path,message",
    [
        ("finetune.lr=.nan", "finetune.lr", "must be a finite number, got nan"),
        ("kmeans.tolerance=.inf", "kmeans.tolerance", "must be a finite number, got inf"),
        ("tasq.det_eps=-.inf", "tasq.det_eps", "must be a finite number, got -inf"),
        ("kmeans.seed=-1", "kmeans.seed", "must be in [0, 2**32), got -1"),
        ("data.seed=4294967296", "data.seed", "must be in [0, 2**32)"),
        ("capture.batch_size=3000000000", "capture.batch_size", "out of range"),
        ("quant.bits=[0.5", "quant.bits", "--set value '[0.5' is not valid YAML"),
        ("output.dir=''", "output.dir", "must not be empty"),
    ],
)
def test_numbers_finite_and_in_range_and_set_values_parsed(override, path, message):
    with pytest.raises(ConfigError) as err:
        load_config({}, [override])
    assert err.value.path == path and message in str(err.value)


def test_a_non_utf8_config_names_the_file_and_byte(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"quant:\n  method: caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"config file {path} is not UTF-8 text \(byte 20"):
        load_config(path)


def test_relative_paths_resolve_against_the_config_folder(tmp_path, monkeypatch):
    """From any working directory: paths in the file against its folder; --set paths against the current one;
    hub ids stay hub ids."""
    (tmp_path / "models" / "m").mkdir(parents=True)
    sub = tmp_path / "configs"
    sub.mkdir()
    (sub / "c.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": "../models/m"},
                "data": {"dataset": "corpus/*.jsonl"},
                "output": {"dir": "runs/a"},
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(sub / "c.yaml")
    assert cfg.model.name_or_path == str(tmp_path / "models" / "m")
    assert cfg.data.dataset == str(sub / "corpus" / "*.jsonl") and cfg.output.dir == str(sub / "runs" / "a")
    cfg = load_config(
        sub / "c.yaml", ["output.dir=mine", "data.dataset=Salesforce/wikitext", "model.name_or_path=org/model"]
    )
    assert cfg.output.dir == str(elsewhere / "mine")
    assert (cfg.data.dataset, cfg.model.name_or_path) == ("Salesforce/wikitext", "org/model")
    cfg = load_config(ROOT / "configs" / "tiny-ouro.yaml")  # the shipped config, run from elsewhere
    assert cfg.model.name_or_path == str(ROOT / "artifacts" / "tiny-ouro")
    assert cfg.data.dataset == str(ROOT / "artifacts" / "data" / "shakespeare-calib.jsonl")
    assert load_config(sub / "c.yaml", ["data.dataset=wikitext"]).data.dataset == "wikitext"  # a bare hub name


@pytest.mark.parametrize(
    "override, path, message",
    [
        ({"lr_schedule": "step"}, "finetune.lr_schedule", "choose one of constant, cosine, linear"),
        ({"parameterization": "lora"}, "finetune.parameterization", "choose one of codewords, affine"),
        ({"parameterization": "affine", "min_usage": 2}, "finetune.min_usage", "needs parameterization codewords"),
        ({"proximal": -1.0}, "finetune.proximal", ">= 0"),
        ({"select_every": -2}, "finetune.select_every", ">= 0"),
        ({"warmup_steps": -1}, "finetune.warmup_steps", ">= 0"),
    ],
)
def test_recipe_options_are_validated(override, path, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config({"finetune": override})
    assert err.value.path == path
