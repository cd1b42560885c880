"""An exclusive lock on a run directory, so two runs of one name never write at once.

Without it, two ``kaisa-train`` processes with the same ``--name`` interleave their lines
in ``metrics.jsonl`` and race on the checkpoint's ``*.partial`` rename. The lock is an
``flock`` on the directory itself: no lock file is left behind, and the kernel drops it
when the process ends, however it ends (also ``SIGKILL``).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["RunDirBusyError", "RunLock"]


class RunDirBusyError(Exception):
    """Another process holds the lock of the run directory; the message is one line."""


class RunLock:
    """Holds an exclusive, non-blocking ``flock`` on ``run_dir`` until :meth:`release`."""

    def __init__(self, run_dir: Path) -> None:
        """Create ``run_dir`` if needed and lock it.

        Raises:
            RunDirBusyError: If another process holds the lock.
            OSError: If the directory cannot be created or opened.
        """
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self._fd: int | None = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._fd)
            self._fd = None
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusyError(
                    f"{run_dir} is in use by another kaisa-train process; wait for it to "
                    "finish or choose another --name"
                ) from None
            raise

    def release(self) -> None:
        """Unlock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
