"""The one ``error:`` line of a failure: on a line of its own below a live progress bar, and the last line, after
the bars a failure left open are closed at the state they reached."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

from loopvq_calib.cli.console import bars_left_open, fail


def test_an_error_gets_its_own_line_below_a_live_progress_bar(capsys):
    bar = tqdm(total=4, desc="capture", file=sys.stderr)
    bar.update(1)
    assert fail("stage capture failed: boom", 3) == 3
    bar.close()
    lines = capsys.readouterr().err.replace("\r", "\n").split("\n")
    assert "error: stage capture failed: boom" in lines  # not glued to the end of the bar's line


def _stage_that_raises(made: list[tqdm], *, file: io.TextIOBase) -> None:
    """A stage that opens a progress bar and raises before closing it."""
    bar = tqdm(total=4, desc="capture", file=file)
    made.append(bar)
    bar.update(1)
    raise OSError("disk full")


def test_the_error_line_is_the_last_one_after_the_bar_its_failure_left_open(capsys):
    made: list[tqdm] = []
    try:
        _stage_that_raises(made, file=sys.stderr)
    except OSError:
        assert fail("stage capture failed: OSError: disk full", 3) == 3
    lines = capsys.readouterr().err.replace("\r", "\n").rstrip("\n").split("\n")
    assert lines[-1] == "error: stage capture failed: OSError: disk full"
    assert lines[-2].startswith("capture:  25%|")  # closed at the state it reached, before the error line
    assert made[0].disable  # closed: nothing draws it again


def test_the_bars_left_open_are_those_in_the_frames_of_the_exception_and_its_causes():
    made: list[tqdm] = []
    elsewhere = tqdm(total=2, file=io.StringIO())  # open, but in no frame the failure unwound

    def run() -> None:
        try:
            _stage_that_raises(made, file=io.StringIO())
        except OSError as err:
            raise RuntimeError("stage capture failed") from err

    try:
        run()
    except RuntimeError as err:
        found = bars_left_open(err)
    assert found == made and len(made) == 1
    assert bars_left_open(None) == []
    for bar in (*made, elsewhere):
        bar.close()
