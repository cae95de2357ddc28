"""One run at a time per run directory: an advisory lock on its ``.loopvq-lock`` file (docs/reliability.md)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

LOCK_FILE = ".loopvq-lock"


class RunLockError(RuntimeError):
    """The run directory's lock cannot be taken: another run holds it, or ``.loopvq-lock`` is not a plain file
    (a symbolic link, a hard link, not a regular file); the message names the file."""


class RunLockedError(RunLockError):
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
        the run that holds it, :class:`RunLockError` when the lock file is not a plain file of its own (opened
        without following a link, checked before anything is written into it)."""
        path = root / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise RunLockError(
                f"{path} is a symbolic link; the run's lock must be a plain file: remove the link (its "
                "target is left alone) and run again"
            ) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(info.st_mode) else "a hard link to another file"
            raise RunLockError(
                f"{path} is {what}; the run's lock must be a plain file of its own: remove it and run again"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{root} is in use by another loopvq-calibrate run ({holder}); wait for it to finish or choose "
                "another --output"
            ) from None
        previous = _lock_holder(fd)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            ).encode(),
            0,
        )
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
