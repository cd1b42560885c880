"""Kills a ``torchrun`` worker with SIGKILL at a planned file operation of a checkpoint save.

Loaded by Python at start-up when this folder is on ``PYTHONPATH`` (the preemption tests
put it there) and ``KAISA_TEST_KILL_PLAN`` names a JSON file ``{"kills": [[rank, op],
...]}``. Launch ``k`` of a run (counted in ``PLAN.done``, one line per kill) kills rank
``kills[k][0]`` at its ``kills[k][1]``-th writing file operation on a path containing
``match`` (default ``.dcp``; open for writing, create, rename, replace, mkdir, rmtree):
anywhere inside a save, from clearing the previous partial directory to removing the old
checkpoint after the swap.
With ``{"count": true}`` it only counts, and appends ``rank count`` to ``PLAN.done`` at exit.
"""

from __future__ import annotations

import os

_PLAN = os.environ.get("KAISA_TEST_KILL_PLAN")
if _PLAN and os.environ.get("RANK") is not None:
    import atexit
    import builtins
    import io
    import json
    import shutil
    import signal
    from typing import Any

    _rank = int(os.environ["RANK"])
    _done_file = _PLAN + ".done"
    with io.FileIO(_PLAN) as _f:
        _plan = json.loads(_f.read())
    _done = 0
    if os.path.exists(_done_file):
        with io.FileIO(_done_file) as _f:
            _done = len(_f.read().split(b"\n")) - 1
    _kills = _plan.get("kills", [])
    _target = _kills[_done][1] if _done < len(_kills) and _kills[_done][0] == _rank else 0
    _counting = bool(_plan.get("count"))
    _match = str(_plan.get("match", ".dcp"))
    _seen = 0

    _os_open = os.open

    def _note(line: str) -> None:
        fd = _os_open(_done_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, line.encode())
        os.close(fd)

    def _hit(path: Any) -> None:
        global _seen
        if not isinstance(path, str | bytes | os.PathLike) or _match not in os.fsdecode(path):
            return
        _seen += 1
        if _target and _seen == _target:
            _note(f"{_rank} {_seen}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def _wrap(function: Any, writing: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if args and writing(*args, **kwargs):
                _hit(args[0])
            return function(*args, **kwargs)
        return wrapped

    def _opens_for_writing(_: Any, mode: str = "r", *rest: Any, **kw: Any) -> bool:
        return any(c in kw.get("mode", mode) for c in "wax+")

    def _os_open_writes(_: Any, flags: int, *rest: Any, **kw: Any) -> bool:
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    always = lambda *a, **k: True  # noqa: E731
    builtins.open = io.open = _wrap(io.open, _opens_for_writing)
    os.open = _wrap(os.open, _os_open_writes)
    for _name in ("rename", "replace", "mkdir", "link"):
        setattr(os, _name, _wrap(getattr(os, _name), always))
    shutil.rmtree = _wrap(shutil.rmtree, always)
    if _counting:
        atexit.register(lambda: _note(f"{_rank} {_seen}\n"))
