"""The fuzz table (tests/test_fuzz.py), bundles through loopvq-inspect: missing or not in the hub cache, metadata,
files or card edited, metadata that is not JSON, too deep, with duplicate keys, a bare NaN, megabyte-long values or
inconsistent fields, a card linked out, a codebooks header of another version. Each case exits 2, naming it in one
short line, and writes and deletes nothing (support/fuzz.py). Then input nested deeper than Python recurses."""

from __future__ import annotations

import pytest
from support.fuzz import (
    DEEP,
    Case,
    assert_refused,
    case_ids,
    edit_meta,
    header_version,
    reseal,
    truncate,
    ws,  # noqa: F401 (the fixture)
)

from loopvq_calib import cli
from loopvq_calib.bundle import hub, reader
from loopvq_calib.cli import inspect_main

CASES: list[Case] = [
    # -- bundles: inspect ------------------------------------------------------------------------------
    (
        "bundle-edited-name",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("name",), "other"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-edited-config-sha",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "config_sha256"), "0" * 64))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-edited-model-type",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("model", "model_type"), "llama"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-bad-meta-sha",
        lambda ws: (inspect_main, [ws.bundle(edit_meta(("meta_sha256",), "xyz"))]),
        2,
        "metadata checksum mismatch",
    ),
    (
        "bundle-truncated-codebooks",
        lambda ws: (inspect_main, [ws.bundle(truncate("codebooks.safetensors"))]),
        2,
        "size mismatch",
    ),
    (
        "bundle-edited-card",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "README.md").write_text("x"))]),
        2,
        "README.md: size mismatch",
    ),
    (
        "bundle-meta-not-json",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_bytes(b"\xff"))]),
        2,
        "loopvq.json: not valid JSON",
    ),
    ("bundle-missing-folder", lambda ws: (inspect_main, [str(ws.root / "nope")]), 2, "nope: no such bundle folder"),
    ("bundle-hub-offline", lambda ws: (inspect_main, ["someorg/not-cached-bundle"]), 2, "not in the local hub cache"),
    # -- files that must not make the toolkit delete, upload or compute the wrong thing (issue: file contents) --
    (
        "bundle-theta-negative",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(theta=-1.0)))]),
        2,
        "rope.theta must be a finite number > 0",
    ),
    (
        "bundle-rope-style-bogus",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(style="bogus")))]),
        2,
        "rope.style is 'bogus'",
    ),
    (
        "bundle-bits-inconsistent",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["bits"].update(key=0.75)))]),
        2,
        "bits.key is 0.75",
    ),
    (
        "bundle-theta-bare-nan",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": NaN')
                    )
                )
            ],
        ),
        2,
        "field rope.theta is a bare NaN, which is not JSON",
    ),
    (
        "bundle-duplicate-key",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": 10000.0, "theta": 5.0')
                    )
                )
            ],
        ),
        2,
        "field rope.theta appears more than once (duplicate JSON key)",
    ),
    (
        "bundle-card-links-out",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: ((p / "README.md").unlink(), (p / "README.md").symlink_to(ws.file("outside.md", "x")))
                )
            ],
        ),
        2,
        "{}/bundle/README.md: files entry 'README.md' is or passes through a symbolic link",
    ),
    # -- what a file can say: bundles ------------------------------------------------------------------
    (
        "inspect-meta-too-deep",
        lambda ws: (inspect_main, [ws.bundle(lambda p: (p / "loopvq.json").write_text(DEEP))]),
        2,
        "{}/bundle/loopvq.json: nested too deeply to read",
    ),
    (
        "bundle-integer-too-long",
        lambda ws: (
            inspect_main,
            [
                ws.bundle(
                    lambda p: (p / "loopvq.json").write_text(
                        (p / "loopvq.json").read_text().replace('"theta": 10000.0', '"theta": ' + "9" * 5000)
                    )
                )
            ],
        ),
        2,
        (
            "{}/bundle/loopvq.json: field rope.theta is an integer of 5,000 digits (999999999999...999999); "
            "at most 30 digits are read"
        ),
    ),
    (
        "inspect-overlong-name",
        lambda ws: (
            inspect_main,
            [ws.bundle(reseal(lambda m: m["files"].update({"a/" * 600 + "x": m["files"]["README.md"]})))],
        ),
        2,
        "is longer than a file name may be (1024 bytes, 255 a component)",
    ),
    (
        "bundle-rope-style-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["rope"].update(style="s" * 5_000_000)))]),
        2,
        "field rope.style is 'sssss",
    ),
    (
        "bundle-block-sites-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["blocks"][0].update(sites=list(range(1_000_000)))))]),
        2,
        "field sites [0, 1, 2, 3, 4, 5, 6, 7, ...] are not distinct sites",
    ),
    (
        "bundle-model-type-huge",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m["model"].update(model_type="m" * 1_000_000)))]),
        2,
        "field model.model_type 'mmmmm",
    ),
    (
        "bundle-codebook-bytes-inconsistent",
        lambda ws: (inspect_main, [ws.bundle(reseal(lambda m: m.update(codebook_bytes=m["codebook_bytes"] + 2)))]),
        2,
        "field codebook_bytes is 8194, but the blocks' codebooks hold",
    ),
    (
        "bundle-header-version-differs",
        lambda ws: (inspect_main, [ws.bundle(header_version("1.0"))]),
        2,
        "codebooks.safetensors: safetensors metadata format_version '1.0' differs from field format_version '1.1'",
    ),
    # -- what a value can say: bundle paths ------------------------------------------------------------
    ("inspect-bundle-path-huge", lambda ws: (inspect_main, ["org/" + "x" * 2_000_000]), 2, "'org/xxxx"),
]


@pytest.mark.parametrize("name,setup,status,fragment", CASES, ids=case_ids(CASES))
def test_bad_input_exits_2_names_it_and_changes_nothing(ws, capsys, name, setup, status, fragment):
    assert_refused(ws, capsys, setup, status, fragment)


@pytest.mark.parametrize(
    "main,module,name,argv",
    [
        (cli.inspect_main, reader, "inspect_bundle", ["b"]),
        (cli.push_main, hub, "push_bundle", ["b", "--repo-id", "org/x", "--dry-run"]),
    ],
)
def test_input_nested_deeper_than_python_recurses_is_one_line_and_exit_2(monkeypatch, capsys, main, module, name, argv):
    """Whatever reader meets it, a RecursionError that reaches a console script is bad input: exit 2, one line."""

    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(module, name, too_deep)
    assert main(argv) == 2
    assert (
        capsys.readouterr().err == "error: an input is nested too deeply to read (maximum recursion depth exceeded)\n"
    )
