"""Helpers to run a function on N gloo ranks in spawned processes.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes on
127.0.0.1, initialises a gloo process group in each (free TCP port, a short
process-group timeout), calls ``fn(rank, world_size, *args)`` and returns the
per-rank return values. Exceptions raised in any rank are re-raised in the
parent with every rank's traceback; a job that outlives ``timeout`` is killed
and reported with :class:`TimeoutError`.

``fn`` must be a module-level function (it is pickled by reference).

The ranks are forked from a multiprocessing fork server that has imported torch and
kaisa once for the session (nothing else runs there: no test state, no CUDA), so a rank
starts in a fraction of a second instead of importing torch again.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    """What one rank reported back."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    exitcode: int | None = None


def _worker(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: tuple[str, Any]
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        out = ("ok", value)
    except BaseException as err:
        out = ("err", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(out, f)
    except Exception:
        with open(path + ".tmp", "wb") as f:
            pickle.dump(("err", "result not picklable:\n" + traceback.format_exc()), f)
    os.replace(path + ".tmp", path)
    if out[0] == "ok":
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    # Skip interpreter teardown: a rank whose peer died can hang there.
    os._exit(0)


_CONTEXT: Any = None


def _context() -> Any:
    """The multiprocessing context of the ranks: a fork server that imported torch and kaisa."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "kaisa", "tests.support.dist"])
        _CONTEXT = ctx
    return _CONTEXT


def run_distributed_raw(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
) -> list[RankResult]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: Module-level function.
        world_size: Number of ranks.
        *args: Extra picklable arguments.
        timeout: Wall-clock limit for the whole job, in seconds.
        pg_timeout: Process-group timeout, in seconds.

    Returns:
        One :class:`RankResult` per rank (no exception raised for failed ranks).

    Raises:
        TimeoutError: If some rank is still running after ``timeout``.
    """
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kaisa-dist-") as result_dir:
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, pg_timeout, result_dir, fn, args),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:
            procs[rank].kill()
        for p in procs:
            p.join(5.0)
        results: list[RankResult] = []
        for rank, p in enumerate(procs):
            path = os.path.join(result_dir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, payload = pickle.load(f)
                if status == "ok":
                    results.append(RankResult(rank, True, value=payload, exitcode=p.exitcode))
                else:
                    results.append(RankResult(rank, False, error=payload, exitcode=p.exitcode))
            else:
                results.append(
                    RankResult(rank, False, error="no result (process exited)", exitcode=p.exitcode)
                )
        if hung:
            details = "\n".join(f"rank {r.rank}: {r.error or 'ok'}" for r in results)
            raise TimeoutError(
                f"ranks {hung} still running after {timeout}s (killed); per-rank:\n{details}"
            )
        return results


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
) -> list[Any]:
    """Like :func:`run_distributed_raw` but raises if any rank failed.

    Returns:
        The per-rank return values of ``fn``.

    Raises:
        RuntimeError: With every failed rank's traceback.
    """
    results = run_distributed_raw(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    failed = [r for r in results if not r.ok]
    if failed:
        msg = "\n".join(f"--- rank {r.rank} (exit {r.exitcode}) ---\n{r.error}" for r in failed)
        raise RuntimeError(f"{len(failed)} of {world_size} ranks failed:\n{msg}")
    return [r.value for r in results]
