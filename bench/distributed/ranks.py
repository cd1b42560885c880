"""Spawned gloo ranks for the distributed benchmarks: a free port, and one run of them all.

A benchmark's worker is ``worker(rank, world, port, *args, out_dir)``; it writes its
results to ``out_dir/rank{rank}.json``. :func:`spawn_ranks` starts every rank in a spawned
process, waits for them within a deadline and returns their results in rank order.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["free_port", "spawn_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(worker: Callable[..., None], world: int, args: Sequence[Any],
                timeout: float) -> list[Any]:
    """Runs ``worker(rank, world, port, *args, out_dir)`` on ``world`` spawned processes.

    Raises:
        TimeoutError: If a rank is not done within ``timeout`` seconds (all are killed).
        RuntimeError: If a rank exits with a non-zero status (-9: killed, e.g. for memory).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=worker, args=(r, world, port, *args, out_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            raise TimeoutError(f"world {world}: not done within {timeout:.0f}s")
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"world {world}: exit codes {[p.exitcode for p in procs]}")
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
