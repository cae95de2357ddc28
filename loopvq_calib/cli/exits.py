"""How a console script ends: its exit statuses, Ctrl-C and SIGTERM, and the process's short exit.

Every status a command returns is one of the constants below (docs/reliability.md, docs/ci.md).
:func:`console_command` wraps a command's ``main(argv) -> status`` so that an interrupt, input nested too deeply
for Python to read or a path too long for any file system ends it with one line and its status.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn

from ..config.source import shown
from .console import fail

OK = 0
GATE_FAILED = 1  # a quality gate or check failed (loopvq-eval only); never bad input
BAD_INPUT = 2  # config, paths, bundle, report: found before any work, nothing written
RUN_FAILED = 3  # the work itself failed: a stage raised, the hub could not be reached, a write failed
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
TERMINATED = 143  # 128 + SIGTERM: what a shell reports for a command killed by SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that every cleanup runs
    (stage records, temporary folders, the run lock) and a rerun resumes as after Ctrl-C."""


def _raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
    """The SIGTERM handler of a running command."""
    raise Terminated()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs (in the main thread: only there can Python handle signals), SIGTERM raises
    :class:`Terminated`; the previous handler comes back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def interrupt_status(err: KeyboardInterrupt) -> int:
    """:data:`TERMINATED` for SIGTERM, :data:`INTERRUPTED` for Ctrl-C (SIGINT)."""
    return TERMINATED if isinstance(err, Terminated) else INTERRUPTED


def interrupt_name(err: KeyboardInterrupt) -> str:
    """The signal that stopped the command."""
    return "SIGTERM" if isinstance(err, Terminated) else "SIGINT"


def console_command(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """A console script's ``main(argv) -> status`` that also maps Ctrl-C and SIGTERM to one line and exit 130 /
    143 (where ``main`` did not already say more, as a calibration run does), and input nested too deeply for
    Python to read or a path too long for any file system to one line and exit 2."""

    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            with sigterm_interrupts():
                return main(argv)
        except KeyboardInterrupt as err:
            return fail(f"interrupted ({interrupt_name(err)})", interrupt_status(err))
        except RecursionError as err:  # only input nested deeper than Python recurses (a JSON file, say) gets here
            return fail(f"an input is nested too deeply to read ({err})", BAD_INPUT)
        except OSError as err:  # a path given or read that no file system takes is bad input; any other is not
            if err.errno != errno.ENAMETOOLONG:
                raise
            return fail(
                f"{shown(err.filename) if err.filename else 'a path'}: {err.strerror} (no file system takes a "
                "name that long)",
                BAD_INPUT,
            )

    return run


def exit_process(status: int) -> NoReturn:
    """End the process with ``status`` once stdout and stderr are flushed, without the interpreter's teardown.

    By then a command has finished everything it owes (run directory and lock released, run.log flushed and
    closed, process group left); what the teardown would add is a garbage collection over every object torch,
    transformers and triton created: about 1 s on a CPU, more after a GPU run (docs/decisions.md, "How a
    command ends"). Library calls and :func:`~loopvq_calib.cli.calibrate.command` return normally."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(status)
