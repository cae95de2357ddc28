"""The bounded reader of input files: regular files only (a FIFO is refused without waiting for a writer, a link is
followed to a regular file only), a cap per kind, lines cut at a bound, JSON numbers bounded before conversion."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from loopvq_calib.runtime import input_files as inputs
from loopvq_calib.runtime.input_files import (
    LongNumber,
    capped_lines,
    check_regular,
    chunks_capped,
    long_number,
    parse_json,
    read_capped,
)


class Refused(ValueError):
    """The caller's error type."""


def test_regular_files_and_links_to_them_are_read_and_everything_else_is_refused(tmp_path):
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    assert read_capped(tmp_path / "link.json", "evaluation report", error=Refused) == b"{}"
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for name, what in (("pipe", "a FIFO (named pipe)"), ("zero", "a character device"), ("", "a folder")):
        with pytest.raises(Refused, match="^" + re.escape(f"{tmp_path / name} is {what}, not a regular file")):
            read_capped(tmp_path / name, "evaluation report", error=Refused)  # a FIFO: refused, never waited on
    with pytest.raises(Refused, match="gone does not exist \\(a broken link\\)"):
        check_regular(tmp_path / "gone", error=Refused)


def test_a_file_past_the_cap_of_its_kind_is_refused_without_reading_it_whole(tmp_path, monkeypatch):
    monkeypatch.setitem(inputs.LIMITS, "evaluation report", 10)
    (tmp_path / "r.json").write_bytes(b"x" * 10)
    assert read_capped(tmp_path / "r.json", "evaluation report", error=Refused) == b"x" * 10
    (tmp_path / "r.json").write_bytes(b"x" * 11)
    with pytest.raises(Refused, match="holds more than 10 bytes, the most a evaluation report may hold"):
        read_capped(tmp_path / "r.json", "evaluation report", error=Refused)
    monkeypatch.setitem(inputs.LIMITS, "tokenizer file", 3 << 20)
    (tmp_path / "t.json").write_bytes(b"y" * (4 << 20))
    with pytest.raises(Refused, match="the most a tokenizer file may hold"):
        list(chunks_capped(tmp_path / "t.json", "tokenizer file", error=Refused))


def test_lines_past_the_bound_are_cut_and_their_rest_skipped():
    data = b"short\n" + b"x" * 25 + b"\nlast"
    assert list(capped_lines(io.BytesIO(data), 10)) == [(b"short\n", 6), (b"x" * 10, 26), (b"last", 4)]


@pytest.mark.parametrize(
    "text,field,described",
    [
        ('{"a": {"b": [1, ' + "9" * 31 + "]}}", "a.b[1]", "an integer of 31 digits (999999999999...999999)"),
        ('{"t": -' + "1" * 400 + "}", "t", "an integer of 400 digits"),
        ('{"x": 1e999}', "x", "the number 1e999, which is no finite float"),
        ('{"x": 0.' + "5" * 60 + "}", "x", "the number 0.5555555555...555555, which is no finite float"),
    ],
)
def test_numbers_too_long_to_convert_are_kept_as_text_and_found_by_field(text, field, described):
    parsed = parse_json(text)
    where, number = long_number(parsed)
    assert where == field and isinstance(number, LongNumber) and number.describe().startswith(described)


def test_numbers_within_the_bounds_parse_as_json_does():
    text = '{"i": ' + "9" * 30 + ', "f": 1.5e300, "n": [-2, 0.25]}'
    assert parse_json(text) == json.loads(text) and long_number(parse_json(text)) is None
