"""The strict YAML loader of config files and --set values: anchors and aliases, merge keys, duplicate keys and
too-deep documents refused with the key path and the line; every value an error shows is cut short."""

from __future__ import annotations

import time

import pytest

from loopvq_calib.cli import calibrate_main
from loopvq_calib.config import source
from loopvq_calib.config.load import load_config
from loopvq_calib.config.source import (
    MAX_DEPTH,
    SHOWN_CHARS,
    ConfigError,
    looks_local,
    parse_yaml,
    resolve_paths,
    shown,
)


def alias_bomb(levels: int = 9) -> str:
    """``quant.bits`` as a list whose aliases expand to 10 * 9**levels values (a billion at 9 levels)."""
    anchors = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    anchors += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "quant:\n  bits: [" + ", ".join(anchors) + "]\n"


def config_error(path, *overrides) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return err.value


def test_an_alias_bomb_is_refused_at_once_naming_the_key_and_line(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    start = time.perf_counter()
    err = config_error(path)
    assert time.perf_counter() - start < 5  # expanded, the value would take minutes and gigabytes
    assert err.path == "quant.bits[0]"
    assert str(err) == (
        f"quant.bits[0]: YAML anchors and aliases are not allowed (&a0 at {path} line 2); write the value out"
    )


@pytest.mark.parametrize(
    "text, path, mark",
    [
        ("model:\n  dtype: &d float32\nkmeans:\n  device: cpu\n", "model.dtype", "&d at {} line 2"),  # an anchor alone
        ("model:\n  dtype: float32\nkmeans:\n  device: *d\n", "kmeans.device", "*d at {} line 4"),  # an alias alone
        ("base: &b {iterations: 3}\nkmeans:\n  <<: *b\n", "base", "&b at {} line 1"),  # a merge key needs one too
    ],
)
def test_anchors_and_aliases_are_refused_wherever_they_are(tmp_path, text, path, mark):
    file = tmp_path / "c.yaml"
    file.write_text(text)
    err = config_error(file)
    assert err.path == path and f"({mark.format(file)})" in str(err)


def test_duplicate_keys_name_the_key_path_and_both_lines(tmp_path):
    file = tmp_path / "c.yaml"
    file.write_text("quant:\n  method: cq\n  method: loopvq\n")
    err = config_error(file)
    assert err.path == "quant.method"
    assert str(err) == f"quant.method: duplicate key ({file} line 2 and line 3); each key may appear once"
    file.write_text("quant:\n  method: cq\ndata:\n  seed: 1\nquant:\n  bits: 0.5\n")  # a whole section twice
    err = config_error(file)
    assert err.path == "quant" and f"({file} line 1 and line 5)" in str(err)
    file.write_text("quant:\n  method: cq\n")
    assert load_config(file).quant.method == "cq"  # the same keys once each load


@pytest.mark.parametrize(
    "text, path, line",
    [
        ("quant:\n  <<: {method: cq}\n  method: loopvq\n", "quant", " line 2"),  # the merge hides a duplicate method
        ("quant: {<<: {method: cq}, bits: 0.5}\n", "quant", ""),  # merged keys nothing repeats; one line: no number
        ("<<: {quant: {method: cq}}\nquant: {method: loopvq}\n", "", " line 1"),  # at the top level
    ],
)
def test_merge_keys_are_refused_naming_the_key_path_and_the_line(tmp_path, text, path, line):
    file = tmp_path / "c.yaml"
    file.write_text(text)
    err = config_error(file)
    assert err.path == path
    assert str(err) == (
        f"{path + ': ' if path else ''}YAML merge keys (<<) are not allowed (<< at {file}{line}); write the keys out"
    )
    file.write_text('quant:\n  "<<": {method: cq}\n')  # a quoted << is a plain key: unknown, not merged
    assert "quant.<<: unknown key" in str(config_error(file))


def test_invalid_yaml_is_one_line_naming_the_file_and_where(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("quant:\n  bits: [0.5,\n")
    assert str(config_error(file)) == (
        f"{file} is not valid YAML: expected the node content, but found '<stream end>' (line 3, column 1)"
    )


def test_a_path_the_file_system_refuses_is_local_and_kept_as_a_path(tmp_path):
    """org/<2 MB> looks like a hub id but no hub id is that long; its existence check raises ENAMETOOLONG."""
    name = "org/" + "a" * 2_000_000
    assert looks_local(name, tmp_path) and looks_local("a" * 2_000_000 + ".jsonl", tmp_path, (".jsonl",))
    raw = resolve_paths({"model": {"name_or_path": name}, "data": {"dataset": "d" * 300_000}}, tmp_path)
    assert raw["model"]["name_or_path"] == str(tmp_path / name)
    assert raw["data"]["dataset"] == str(tmp_path / ("d" * 300_000))
    assert looks_local("org/name", tmp_path) is False  # a hub id stays one


def test_set_values_go_through_the_same_loader():
    err = config_error({}, "quant={method: cq, method: loopvq}")
    assert err.path == "quant.method" and "duplicate key (--set quant twice)" in str(err)
    err = config_error({}, "quant.bits=[&a [1], *a]")
    assert err.path == "quant.bits[0]" and "anchors and aliases are not allowed (&a at --set quant.bits)" in str(err)
    err = config_error({}, "quant.bits=" + "[" * 20000 + "]" * 20000)
    assert err.path.startswith("quant.bits[0][0]") and f"nested deeper than {MAX_DEPTH} levels" in str(err)
    two = load_config({}, ["quant.method=cq", "quant.method=tasq"])  # the same key set twice: the last one wins
    assert two.quant.method == "tasq"


def test_a_deep_document_is_refused_and_the_depth_limit_is_exact(tmp_path):
    file = tmp_path / "deep.yaml"
    file.write_text("quant:\n  bits: " + "[" * 20000 + "]" * 20000 + "\n")
    err = config_error(file)
    assert err.path.startswith("quant.bits[0]") and err.path.endswith("...") and len(err.path) == SHOWN_CHARS
    assert f"nested deeper than {MAX_DEPTH} levels ({file} line 2)" in str(err)
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH  # the document's node, then MAX_DEPTH - 1 lists inside it
    value = parse_yaml(nested, "test")
    for _ in range(MAX_DEPTH - 1):
        (value,) = value
    assert value == []
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_DEPTH} levels"):
        parse_yaml("[" + nested + "]", "test")


def test_a_recursion_error_while_reading_is_a_config_error(monkeypatch):
    """Even without the depth limit (a nested key, say), a document too deep for the interpreter is bad input."""
    monkeypatch.setattr(source, "MAX_DEPTH", 10**9)
    with pytest.raises(ConfigError, match="test is nested too deeply to read"):
        parse_yaml("[" * 20000 + "]" * 20000, "test")


def test_an_error_shows_a_long_value_cut_short():
    err = config_error({"quant": {"method": "x" * 100_000}})
    assert (
        str(err) == f"quant.method: {shown('x' * 100_000)} is not allowed; choose one of cq, tasq, loopvq, tasq+loopvq"
    )
    assert len(shown("x" * 100_000)) == SHOWN_CHARS and "..." in shown("x" * 100_000)
    err = config_error({"quant": {"bits": list(range(100_000))}})
    assert str(err).startswith("quant.bits: expected float, got list [0, 1, 2,") and len(str(err)) < 150
    assert shown("cq") == "'cq'" and shown(0.5) == "0.5" and shown(None) == "None"  # short values as repr


def test_unknown_and_duplicate_keys_are_named_short_whatever_their_type_or_length(tmp_path):
    err = config_error({"quant": {1: "a", "b": "c"}})  # a number and a string: sorted without comparing them
    assert err.path == "quant.1" and "unknown key; allowed here: bits," in str(err)
    long = "k" * 1000  # (YAML allows plain keys of up to 1024 characters)
    assert config_error({"quant": {long: 1}}).path == f"quant.{shown(long)}"
    file = tmp_path / "c.yaml"
    file.write_text(f"quant:\n  {long}: 1\n  {long}: 2\n")
    err = config_error(file)
    assert err.path == f"quant.{shown(long)}" and len(str(err)) < 250 and "duplicate key" in str(err)


def test_shown_is_bounded_for_values_that_would_be_huge_to_format():
    shared = ["x"] * 10
    for _ in range(9):  # a billion leaves, as the expanded alias bomb
        shared = [shared] * 9
    start = time.perf_counter()
    assert len(shown(shared)) <= SHOWN_CHARS and shown(shared).startswith("[[[")
    assert shown(16**20000) == f"<an integer of {(16**20000).bit_length()} bits>"  # repr() itself would raise
    assert time.perf_counter() - start < 1


@pytest.mark.parametrize(
    "value, message",
    [
        ("0x" + "f" * 20000, "is out of range for a float"),  # an int of 80,000 bits where a float goes
        ("1" * 20000, "Exceeds the limit (4300 digits) for integer string conversion"),  # PyYAML's int() refuses it
    ],
)
def test_huge_numbers_are_config_errors(value, message):
    err = config_error({}, f"quant.bits={value}")
    assert err.path == "quant.bits" and message in str(err) and len(str(err)) < 300


def test_cli_exits_2_with_one_line_for_a_bomb_and_a_deep_list(tmp_path, capsys):
    for name, text in (("bomb", alias_bomb()), ("deep", "quant:\n  bits: " + "[" * 20000 + "]" * 20000 + "\n")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        assert calibrate_main(["--config", str(path), "--output", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: config error: quant.bits[0]")
    assert not (tmp_path / "run").exists()
