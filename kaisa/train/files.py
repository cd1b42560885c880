"""Writing the run's files so that a failure never leaves a half-written one.

A full disk, a file-size limit (``ulimit -f``), a read-only directory or Ctrl-C can stop a
write anywhere. Whole files (checkpoints, summary, table, plot) are written to
``*.partial`` and renamed, and the partial file is removed when the write fails;
``metrics.jsonl`` gets whole lines only (a failed append is cut off again). Every
``OSError`` raised here names the file it was writing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

__all__ = ["AppendFile", "deferred_interrupt", "write_atomic"]


def _named(err: OSError, path: Path) -> OSError:
    """``err`` with ``path`` as its file name (``os.write`` errors carry none)."""
    return OSError(err.errno, err.strerror or str(err), str(path))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``path.partial`` and a rename.

    On any failure (also ``KeyboardInterrupt``) the partial file is removed and the
    previous ``path`` is left as it was.

    Raises:
        OSError: Naming ``path``, if it cannot be written.
    """
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise _named(err, path) from None
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


class AppendFile:
    """A line-oriented file that only ever holds whole lines.

    Opened on an existing file (``--resume``), the new content goes to ``path.partial``
    and replaces ``path`` only once every line of the old file other than those for
    which ``is_header`` holds has been written again (or on :meth:`close`), so a
    failure early in a resumed run keeps the old file whole.
    """

    def __init__(self, path: Path, is_header: str = "") -> None:
        """Open ``path`` for writing; ``is_header`` prefixes the lines not waited for.

        Raises:
            OSError: Naming the file, if it cannot be created.
        """
        self.path = path
        self._pending: Counter[str] = Counter()
        if path.is_file():
            old = path.read_text(encoding="utf-8", errors="replace").splitlines()
            self._pending.update(
                line for line in old if line and not (is_header and line.startswith(is_header))
            )
        self._target = path.with_name(path.name + ".partial") if self._pending else path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(
                self._target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
            )
        except OSError as err:
            raise _named(err, self._target) from None
        self._size = 0

    def append(self, line: str) -> None:
        """Append ``line`` and a newline, or nothing at all if the write fails.

        Raises:
            OSError: Naming the file, if it cannot be written.
        """
        assert self._fd is not None, "file is closed"
        data = (line + "\n").encode("utf-8")
        try:
            _write_all(self._fd, data)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            if isinstance(err, OSError):
                raise _named(err, self.path) from None
            raise
        self._size += len(data)
        if self._pending[line] > 0:
            self._pending[line] -= 1
            if self._pending[line] == 0:
                del self._pending[line]
            if not self._pending:
                self._swap()

    def _swap(self) -> None:
        if self._target != self.path:
            os.replace(self._target, self.path)
            self._target = self.path

    def close(self) -> None:
        """Close; the file is complete, so it replaces any older one."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._swap()

    def abort(self) -> None:
        """Close after a failure: an older file not yet caught up with is kept."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._target != self.path:
            self._target.unlink(missing_ok=True)


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold back Ctrl-C (``SIGINT``) until the block is done, then raise it.

    Used around "write the checkpoint, then its metrics line", so an interrupt never
    falls between the two. Outside the main thread, or when ``SIGINT`` has a custom
    handler, it does nothing.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
