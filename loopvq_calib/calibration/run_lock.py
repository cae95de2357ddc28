"""One run at a time per run directory: an advisory lock on its ``.loopvq-lock`` file (docs/reliability.md)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".loopvq-lock"


class RunLockedError(RuntimeError):
    """Another run holds the run directory's lock (the message names it)."""


class RunLock:
    """An advisory lock on a run directory: ``flock`` on ``.loopvq-lock``, which names its holder (pid,
    host, start time) while it runs and is emptied on release. The kernel drops the lock when the holder
    dies, so a killed run's lock is taken over by the next run, which logs whose it was."""

    def __init__(self, path: Path, fd: int, previous: str | None = None) -> None:
        """``previous``: the holder named in the file when the lock was taken (a run that died), or None."""
        self.path, self.fd, self.previous = path, fd, previous

    @classmethod
    def acquire(cls, root: Path) -> RunLock:
        """Take the lock of the run directory ``root`` (which exists), or raise :class:`RunLockedError` naming
        the run that holds it."""
        path = root / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{root} is in use by another loopvq-calibrate run ({holder}); wait for it to finish or choose "
                "another --output") from None
        previous = _lock_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        return cls(path, fd, previous if previous != "holder unknown" else None)

    def release(self) -> None:
        """Clear the holder record (only a run that died leaves one behind), then unlock."""
        os.ftruncate(self.fd, 0)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _lock_holder(fd: int) -> str:
    """The holder the lock file names, in words ("holder unknown" when it names none)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (ValueError, TypeError, KeyError):
        return "holder unknown"
