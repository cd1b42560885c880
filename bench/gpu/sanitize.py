"""The GPU script's sanitizer stage: each compute-sanitizer tool over the kernel cases,
resumed past a case that kills the process (as ``gpu_tests`` does for pytest).

A sanitizer can stop the program at a hardware exception it cannot attribute, which
would leave every later case unchecked: the case after the last one reported is recorded
as ``crashed`` and the tool runs again from the case after it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from gpu_tests import Finished

CASE_LINE = re.compile(r"^(ok|FAIL) +([^:\n]+?)(?::.*)?$", re.MULTILINE)
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
ERROR_EXIT = 86
"""compute-sanitizer's ``--error-exitcode``: it found errors."""

Run = Callable[[list[str], float], Finished]


def run_tool(run: Run, command: list[str], names: list[str], seconds: float,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Runs ``command`` (the sanitizer and the cases script) until every case reported.

    Returns the tool's status (``passed``: every case ``ok`` and no sanitizer error),
    its error count, each case's result and the seconds taken.
    """
    start = time.monotonic()
    deadline = start + seconds
    results: dict[str, str] = {}
    errors = 0
    status = "passed"
    after: str | None = None
    while len(results) < len(names):
        left = deadline - time.monotonic()
        if left < 2:
            status = "timed out"
            break
        out = run([*command, *(["--after", after] if after else [])], left)
        log(f"$ {' '.join(command)}{' --after ' + repr(after) if after else ''}\n{out.output}")
        for verdict, name in CASE_LINE.findall(out.output):
            results[name.strip()] = verdict
        errors += sum(int(n) for n in SUMMARY.findall(out.output))
        if out.rc is None:
            status = "timed out"
            break
        if out.rc == ERROR_EXIT:
            status = "errors"
        missing = [n for n in names if n not in results]
        if not missing:
            break
        results[missing[0]] = "crashed"  # in order: the first unreported case stopped it
        after = missing[0]
    if status == "passed" and any(v != "ok" for v in results.values()):
        status = "failed"
    if status == "passed" and len(results) < len(names):
        status = "failed"
    return {"status": status, "errors": errors, "cases": results,
            "seconds": round(time.monotonic() - start, 1)}
