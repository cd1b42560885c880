"""Helpers of the preemption tests: comparable metrics, checkpoints, waiting on a run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

#: Record fields that measure time: they differ between any two runs.
TIMES = ("time", "wall", "seconds_per_iter", "kfac")


def records(run: Path) -> list[dict[str, Any]]:
    """The epoch records of ``run/metrics.jsonl`` without their times (fails on a torn line)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES}
            for r in lines if r.get("type") != "settings"]


def epochs_written(run: Path) -> int:
    """How many epoch records ``run/metrics.jsonl`` holds now (0 while it does not exist)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"type": "settings"' not in line for line in path.read_text().splitlines()
               if line.endswith("}"))


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal bit for bit (tensors by ``torch.equal``, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b) or bool((a.isnan() & b.isnan() | (a == b)).all()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, set(a) ^ set(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, where
    else:
        assert a == b, (where, a, b)


def learned_state(path: Path) -> dict[str, Any]:
    """What a ``.pt`` checkpoint holds that training computed (no times, no settings)."""
    state = torch.load(path, weights_only=True)
    keep = ("epoch", "steps", "model", "optimizer", "preconditioner", "scheduler", "rng")
    return {k: state[k] for k in keep}


def wait_until(condition: Any, *, timeout: float, what: str, alive: Any = None) -> None:
    """Polls ``condition()`` every 20 ms; fails after ``timeout`` s or when ``alive()`` is False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if alive is not None and not alive():
            raise AssertionError(f"the run ended before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
