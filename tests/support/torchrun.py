"""``kaisa-train`` under a real ``torchrun`` (gloo on 127.0.0.1), for the app's tests.

A failing launch reports what a person needs to see: torchrun's own summary names the
rank that failed first, but a rank's error (a Python traceback, a C++ exception that
aborted it, a fatal signal's report) is printed earlier, interleaved with the other
ranks' output, and is lost in the tail of a long stderr. :func:`torchrun` puts the lines
that look like an error first, the tail after them, and keeps the whole stderr in a file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

_ERROR = re.compile(
    r"Error|Exception|terminate called|what\(\)|Fatal|Abort|SIG[A-Z]+|Segmentation|"
    r"Traceback|assert|corrupt|double free|invalid pointer|ENFORCE"
)
"""Lines of a rank's stderr that report an error."""

GLOO_CONNECT_ABORT = re.compile(r"getpeername: |SO_ERROR: ")
"""gloo's TCP transport aborting a rank while it connects a pair: ``Pair::handleConnected``
enforces that ``getpeername`` succeeds, and throws from its event-loop thread (so the rank
dies of SIGABRT) when the peer's socket closed between ``accept`` and that call, which
happens on a loaded machine (pytorch/gloo#514, open). It is neither kaisa's nor the test's
fault: a launch that dies of it, and of nothing else, is run once more (with a warning)."""


def torchrun(
    ranks: int, args: list[str], *, log_dir: Path, timeout: float = 240,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs ``torchrun --standalone --nproc_per_node=ranks -m kaisa.train *args``.

    One thread per rank and the torch backend of the kernels (``KAISA_BACKEND=torch``), as
    the app's distributed tests compare runs bit for bit. The whole stderr is written to
    ``log_dir/torchrun-<k>.stderr`` (k counts the launches); a non-zero exit fails the
    calling test with the error lines and the tail.
    """
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
               f"--nproc_per_node={ranks}", "-m", "kaisa.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KAISA_BACKEND": "torch"}
    log_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args[args.index("--run-dir") + 1]) if "--run-dir" in args else None
    with tempfile.TemporaryDirectory() as saved:
        if run_dir is not None and run_dir.is_dir():  # what the launch starts from
            shutil.copytree(run_dir, Path(saved) / "run", dirs_exist_ok=True,
                            ignore=lambda d, names: [n for n in names if Path(d, n) == log_dir])
        for attempt in (1, 2):
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                                    env=env, cwd=cwd)
            log = log_dir / f"torchrun-{len(list(log_dir.glob('torchrun-*.stderr')))}.stderr"
            log.write_text(result.stderr)
            if result.returncode == 0 or attempt == 2 or not _gloo_connect_abort(result.stderr):
                break
            warnings.warn(f"gloo aborted a rank while connecting (pytorch/gloo#514; {log}): "
                          "launched once more, from the run folder as it was", stacklevel=2)
            if run_dir is not None and run_dir.is_dir():
                _restore(run_dir, Path(saved) / "run", keep=log_dir)
    if result.returncode != 0:
        lines = result.stderr.splitlines()
        errors = [line for line in lines if _ERROR.search(line)]
        raise AssertionError(
            f"torchrun exited {result.returncode}: {' '.join(command[1:])}\n"
            f"--- error lines of stderr ({len(errors)}; first 60) ---\n"
            + "\n".join(errors[:60])
            + f"\n--- last 40 of {len(lines)} lines (all in {log}) ---\n"
            + "\n".join(lines[-40:])
        )
    return result


def _gloo_connect_abort(stderr: str) -> bool:
    """Whether the ranks that failed died of :data:`GLOO_CONNECT_ABORT` and of nothing else:
    the abort's message is there, and no Python traceback but the ones of ranks that lost
    their connection to the aborted one."""
    if not GLOO_CONNECT_ABORT.search(stderr):
        return False
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return all("Connection closed by peer" in block or "Connection reset by peer" in block
               or "ChildFailedError" in block for block in blocks)


def _restore(run_dir: Path, saved: Path, *, keep: Path) -> None:
    """Puts ``run_dir`` back as ``saved`` holds it (a crashed launch may have written run
    files, a checkpoint or a lock the relaunch would refuse), leaving ``keep`` alone."""
    for entry in run_dir.iterdir():
        if entry == keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if saved.exists():
        shutil.copytree(saved, run_dir, dirs_exist_ok=True)
