"""A pytest plugin: each test's outcome (and a failure's last line) printed the moment it
is known, so a process that dies later keeps every earlier outcome in its output.
A failure's message is the first line of its error (pytest's ``reprcrash``).

    python -m pytest -p outcome_plugin ...      (with bench/gpu on PYTHONPATH)

Each line: ``KAISA-OUTCOME <test id> <PASSED|FAILED|ERROR|SKIPPED> <message>``.
"""

from __future__ import annotations

from typing import Any

PREFIX = "KAISA-OUTCOME"
_config: Any = None


def pytest_configure(config: Any) -> None:
    """Keeps the config: the terminal reporter writes past pytest's output capture."""
    global _config
    _config = config


def pytest_runtest_logreport(report: Any) -> None:
    """Prints the outcome of a test's call, or of a setup / teardown that did not pass."""
    if report.when != "call" and report.passed:
        return
    if report.when != "call" and report.skipped and report.when != "setup":
        return
    if report.skipped:
        outcome = "SKIPPED"
    elif report.failed:
        outcome = "FAILED" if report.when == "call" else "ERROR"
    else:
        outcome = "PASSED"
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        text = crash.message if crash is not None else (report.longreprtext or "")
        lines = text.strip().splitlines()
        message = lines[0][:200] if lines else ""
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    line = f"{PREFIX} {report.nodeid} {outcome} {message}".rstrip()
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(line)
        reporter._tw.flush()
    else:
        print(line, flush=True)
