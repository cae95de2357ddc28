"""What a command shows besides its result: the one ``error:`` line of a failure, drawn below any progress bar,
and the libraries' own progress bars turned off."""

from __future__ import annotations

import os
import sys
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm


def fail(message: str, status: int) -> int:
    """Print ``error: message`` on a line of its own, the last one, and return ``status``. Called while an exception
    is handled, the progress bars it left drawn (a stage that raised never closed its own) are closed first, at the
    state they reached."""
    from tqdm import tqdm

    for bar in bars_left_open(sys.exc_info()[1]):
        bar.close()
    tqdm.write(f"error: {message}", file=sys.stderr)
    return status


def bars_left_open(err: BaseException | None) -> list[tqdm]:
    """The progress bars held in the frames that ``err`` (and the exceptions it chains) unwound, below the frame
    that caught it: a bar still drawn there is one whose stage raised before closing it (closing a closed bar
    again does nothing)."""
    from tqdm import tqdm

    bars: dict[int, tqdm] = {}
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        caught_in = err.__traceback__
        for frame, _ in traceback.walk_tb(caught_in.tb_next if caught_in is not None else None):
            bars.update((id(value), value) for value in frame.f_locals.values() if isinstance(value, tqdm))
        err = err.__cause__ or err.__context__
    return list(bars.values())


def quiet_libraries() -> None:
    """Turn off the libraries' own progress bars (datasets' "Generating train split", transformers' "Loading weights",
    which nests under ours) before they are imported; HF_DATASETS_DISABLE_PROGRESS_BARS=0 still wins, hub bars stay."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
