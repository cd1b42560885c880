"""The GPU script's test stage: pytest in one process, resumed past a test that crashes it.

A CUDA kernel (or a toolchain problem) can kill the Python process: a segmentation
fault ends pytest before it writes any report, and every later test goes unrun. So the
test ids are collected first, then run in order with ``outcome_plugin`` (each outcome,
with the first line of a failure's error, printed as it happens); when the process dies, the first
test without an outcome is the one that crashed it: it is recorded as ``crashed`` and
the run resumes after it. Timing out keeps whatever outcomes were printed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

OUTCOME = re.compile(r"KAISA-OUTCOME (\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED) ?(.*)$",
                     re.MULTILINE)
"""A line of ``outcome_plugin``: the test id, its outcome, a failure's first error line."""

PLUGIN = ["-p", "outcome_plugin"]
"""pytest's arguments that load it (``bench/gpu`` on ``PYTHONPATH``)."""


class Finished(Protocol):
    """What a finished (or killed) subprocess gives back."""

    rc: int | None
    output: str


Runner = Callable[[list[str], float], Finished]
"""Runs pytest with the given arguments within the given seconds."""


@dataclass
class Outcomes:
    """Every test's outcome, the failures' messages and the pytest runs it took."""

    collected: list[str] = field(default_factory=list)
    outcome: dict[str, str] = field(default_factory=dict)
    message: dict[str, str] = field(default_factory=dict)
    runs: int = 0
    timed_out: bool = False

    def summary(self, limit: int = 60) -> dict[str, Any]:
        """Counts by outcome, and the failing, erroring and crashing tests with messages."""
        counts: dict[str, int] = {}
        for result in self.outcome.values():
            counts[result.lower()] = counts.get(result.lower(), 0) + 1
        bad = [t for t in self.collected if self.outcome.get(t) in ("FAILED", "ERROR", "CRASHED")]
        return {
            "collected": len(self.collected),
            **{k: counts.get(k, 0) for k in ("passed", "failed", "error", "skipped", "crashed")},
            "not_run": len([t for t in self.collected if t not in self.outcome]),
            "pytest_runs": self.runs,
            "timed_out": self.timed_out,
            "failures": {t: f"{self.outcome[t]}: {self.message.get(t, '')}"[:240]
                         for t in bad[:limit]},
        }


def collect(run: Runner, targets: list[str], timeout: float) -> tuple[list[str], str]:
    """The test ids ``targets`` select, in run order, and pytest's output."""
    out = run(["--collect-only", "-q", *targets], timeout)
    ids = [line.strip() for line in out.output.splitlines() if "::" in line and " " not in
           line.strip()]
    return ids, out.output


def representative(ids: list[str]) -> list[str]:
    """Ids covering, for every test function, each value of each of its parameters once.

    A test id ``path::name[a-b-c]`` has the parameter values ``a``, ``b``, ``c`` (by
    position); ids are taken in order while they add a (function, position, value) not
    taken yet, so every function runs, on every dtype, shape and flag it is parametrised
    with, in a handful of ids instead of their product. Ids without parameters are all
    kept.

    Args:
        ids: The collected ids, in run order.

    Returns:
        The chosen ids, in run order.
    """
    seen: set[tuple[str, int, str]] = set()
    chosen = []
    for test in ids:
        name, _, params = test.partition("[")
        values = {(name, i, v) for i, v in enumerate(params.rstrip("]").split("-"))}
        if not params or not values <= seen:
            chosen.append(test)
            seen |= values
    return chosen


def run_resumable(run: Runner, ids: list[str], seconds: float,
                  log: Callable[[str], None]) -> Outcomes:
    """Runs ``ids`` in order within ``seconds``, resuming after any test that kills pytest."""
    result = Outcomes(collected=list(ids))
    deadline = time.monotonic() + seconds
    remaining = list(ids)
    while remaining:
        left = deadline - time.monotonic()
        if left < 3:
            result.timed_out = True
            break
        out = run([*PLUGIN, "-q", *remaining], left)
        result.runs += 1
        log(out.output)
        for test, outcome, message in OUTCOME.findall(out.output):
            if test not in result.outcome or outcome in ("FAILED", "ERROR"):
                result.outcome[test] = outcome  # a teardown error after a pass counts
                if message:
                    result.message[test] = message
        remaining = [t for t in remaining if t not in result.outcome]
        if out.rc is None:
            result.timed_out = True
            break
        if not remaining:
            break
        if out.rc in (0, 1, 2, 5) and "Fatal Python error" not in out.output:
            break  # pytest ended on its own yet reported no outcome for these: not run
        crashed = remaining.pop(0)  # run in order: the first without an outcome died
        result.outcome[crashed] = "CRASHED"
        fatal = re.search(r"Fatal Python error: ([^\n]*)", out.output)
        result.message[crashed] = fatal.group(1) if fatal else f"pytest exit code {out.rc}"
    return result
