"""What every benchmark of ``bench/`` shares: interleaved timing, the environment, one JSON schema.

A script imports it with the repository root on ``sys.path`` (``python bench/<folder>/<x>.py``
puts only the script's own folder there)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
    from bench import harness

* :func:`parser`: an ``argparse`` parser described by the script's docstring, with ``--out``.
* :func:`interleaved`: round-robin timing of several configurations (every configuration
  once per round, the order rotated every round, so a slow patch of the machine falls on
  all alike), and :func:`summary`: per configuration the median and the ratio of medians
  to a baseline timed in the same run.
* :func:`environment`: the record of where and when a result was made (torch and Python
  versions, threads, CPU, kaisa's backend, git commit, date, host, load average).
* :func:`write`: the one JSON schema of ``bench/results/``::

      {"schema": 1, "benchmark": "step_cost",
       "command": "python bench/step_cost/step_cost.py --rounds 10",
       "environment": {...},            # environment()
       ...}                             # the benchmark's own results

  The benchmark's results sit beside the four envelope keys (so a result written before
  the schema reads the same way: :func:`load` returns either). ``bench/results/README.md``
  indexes the committed files.

pytest-benchmark runs the kernel comparisons (``bench/kernels/``); its JSON is its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: ``bench/``, the repository root and the committed results.
BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
#: The envelope's version (``write``).
SCHEMA = 1


def parser(doc: str | None, out: Path | str | None = None) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--out`` (default ``out``)."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is not None:
        p.add_argument("--out", type=Path, default=Path(out), help=f"JSON path (default {out})")
    return p


def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes), ``None`` outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(**extra: Any) -> dict[str, Any]:
    """Where and when: versions, threads, CPU, backend, git commit, UTC date; plus ``extra``."""
    import torch

    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import kaisa.ops

        env["kaisa_backend"] = kaisa.ops.backend()
    except Exception as err:  # a baseline checkout may lack it; the record still stands
        env["kaisa_backend"] = f"unavailable: {err}"
    if torch.cuda.is_available():
        env["cuda_device"] = torch.cuda.get_device_name()
    env.update(extra)
    return env


def command(script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command line that reproduces a run: ``python <script from the root> <argv>``.

    ``script`` defaults to ``sys.argv[0]`` (relative to the root), ``argv`` to
    ``sys.argv[1:]`` (tests call a script's ``main(argv)`` under pytest's own ``sys.argv``);
    ``script`` may hold interpreter options too (``"-m pytest bench/kernels/x.py"``).
    """
    if argv is None:
        argv = sys.argv[1:]
    if script is None:
        path = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else Path("?")
        try:
            script = str(path.relative_to(ROOT))
        except ValueError:
            script = path.name
    return shlex.join(["python", *shlex.split(script), *map(str, argv)])


def envelope(benchmark: str, payload: Mapping[str, Any], argv: Sequence[str] | None = None,
             script: str | None = None, **env: Any) -> dict[str, Any]:
    """The schema's document: the envelope keys first, then ``payload``'s own."""
    doc: dict[str, Any] = {"schema": SCHEMA, "benchmark": benchmark,
                           "command": command(script, argv), "environment": environment(**env)}
    clash = set(doc) & set(payload)
    if clash:
        raise ValueError(f"payload keys {sorted(clash)} are the envelope's")
    doc.update(payload)
    return doc


def write(out: Path | str, benchmark: str, payload: Mapping[str, Any],
          argv: Sequence[str] | None = None, script: str | None = None,
          indent: int = 1, **env: Any) -> dict[str, Any]:
    """Writes :func:`envelope`'s document to ``out`` (folders made) and returns it.

    ``argv``: the script's arguments (default ``sys.argv[1:]``); ``script``: its path from
    the repository root when ``sys.argv[0]`` is not the script (tests call ``main(argv)``).
    """
    doc = envelope(benchmark, payload, argv, script, **env)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = portable(json.dumps(doc, indent=indent, default=str))
    out.write_text(text + "\n")
    return json.loads(text)  # type: ignore[no-any-return]


#: An absolute path of a machine's own folders (a work tree, a temporary or output folder):
#: what a committed result must not record (``portable``).
MACHINE_PATH = re.compile(r"(?<![\w.$<>-])/(?:tmp|work|root|home|private|var/folders|scratch)"
                          r"(?:/[^\s\"',;:]*)?")


def portable(text: str) -> str:
    """``text`` with the machine's own absolute paths replaced.

    A path inside this checkout becomes relative to its root; any other path of a work
    tree, a temporary or an output folder becomes ``<dir>/`` and its last part, so a result
    file says which file it meant without naming the machine's folders.
    """
    def replace(match: re.Match[str]) -> str:
        path = match.group(0)
        try:
            return str(Path(path).relative_to(ROOT))
        except ValueError:
            return "<dir>/" + Path(path).name if Path(path).name else "<dir>"

    return MACHINE_PATH.sub(replace, text)


def load(path: Path | str) -> dict[str, Any]:
    """A result file's document (the schema's, or an older file's own)."""
    doc: dict[str, Any] = json.loads(Path(path).read_text())
    return doc


def interleaved(fns: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 0,
                repeat: int = 1, rotate: bool = True,
                sync: Callable[[], object] | None = None,
                before_round: Callable[[int], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of every configuration, timed round-robin.

    ``warmup`` untimed rounds first; then ``rounds`` rounds, each calling every
    configuration ``repeat`` times in a row (the recorded time is their mean), the
    order rotated by one every round when ``rotate``. ``sync`` (e.g.
    ``torch.cuda.synchronize``) runs before each clock read; ``before_round(r)`` (untimed)
    before timed round ``r`` (e.g. drawing the round's batches, the same for every
    configuration).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        shift = r % len(names) if rotate and names else 0
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            if sync is not None:
                sync()
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            if sync is not None:
                sync()
            times[name].append((time.perf_counter() - start) / repeat)
    return times


def summary(times: Mapping[str, Sequence[float]], baseline: str | None = None,
            scale: float = 1e3) -> dict[str, dict[str, float]]:
    """Per configuration: median (times ``scale``: milliseconds by default), the number of
    samples and, given a ``baseline`` of the same run, the ratio of medians to it."""
    med = {name: statistics.median(ts) for name, ts in times.items() if ts}
    out: dict[str, dict[str, float]] = {}
    for name, m in med.items():
        entry: dict[str, float] = {"median": scale * m, "samples": len(times[name])}
        if baseline is not None and med.get(baseline):
            entry["ratio_to_baseline"] = m / med[baseline]
        out[name] = entry
    return out


def ratio_of_medians(after: Sequence[float], before: Sequence[float]) -> float:
    """``median(after) / median(before)``: < 1 is faster."""
    return statistics.median(after) / statistics.median(before)
