"""The GPU script's JSON: what every result file must hold (``validate``).

One file per run, ``gpu-<device>-<date>.json``: the run's ``device``, ``date``,
``environment`` (driver, nvcc, torch, CuPy, compute-sanitizer), ``budget_s`` and
``seconds``, and per stage (``environment``, ``build``, ``tests``, ``sanitizer``,
``kernels``, ``step_cost``) its ``status`` (``passed``, ``failed``, ``errors``,
``timed out`` or ``not run (...)``), ``seconds`` and, where it ran, its ``detail``:

* ``kernels``: ``ceilings`` (measured copy GB/s and matmul TFLOP/s) and ``results``:
  group -> row -> ``ms`` (``kaisa`` and each alternative), ``speedup_vs_best``,
  ``floor_ms`` and ``gap`` (kaisa / floor); ``syevj_knee`` its own shape. The groups
  ``inverse`` (kaisa: the Cholesky inverse; Newton-Schulz warm and cold) and
  ``eigen_refresh`` (kaisa: eigh; the warm refresh) have the same fields, their rows
  also iterations and product errors.
* ``step_cost``: ``tasks``: task -> ``configs``: name -> ``ms_per_step``, ``ratio``
  (against ``baseline``), ``labels``, ``peak_gib`` and (runs since the captured column)
  ``captured``: the ``label`` of the step captured in a CUDA graph and its replay's
  ``median_ms`` (with ``ratio``) or why it was not (``error``); or the task's ``error``.
"""

from __future__ import annotations

from typing import Any

STAGE_NAMES = ("environment", "build", "tests", "sanitizer", "kernels", "step_cost")
STATUSES = ("passed", "failed", "errors", "timed out")


def _status_ok(status: object) -> bool:
    return isinstance(status, str) and (status in STATUSES or status.startswith("not run"))


def _kernels(detail: dict[str, Any]) -> list[str]:
    problems = []
    if not isinstance(detail.get("ceilings"), dict) or not detail["ceilings"]:
        problems.append("kernels: no ceilings")
    results = detail.get("results")
    if not isinstance(results, dict) or not results:
        return [*problems, "kernels: no results"]
    for group, rows in results.items():
        if group == "syevj_knee":
            if "measured_knee_n" not in rows or not rows.get("sizes"):
                problems.append("kernels: syevj_knee without sizes or knee")
            continue
        for key, row in rows.items():
            for field in ("ms", "speedup_vs_best", "floor_ms", "gap"):
                if field not in row:
                    problems.append(f"kernels: {group}/{key} lacks {field}")
            if "kaisa" not in row.get("ms", {}):
                problems.append(f"kernels: {group}/{key} has no kaisa time")
    return problems


def _step_cost(detail: dict[str, Any]) -> list[str]:
    tasks = detail.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        return ["step_cost: no tasks"]
    problems = []
    for task, entry in tasks.items():
        if "error" in entry:
            continue
        for name, row in entry.get("configs", {}).items():
            for field in ("ms_per_step", "ratio", "baseline", "labels", "peak_gib"):
                if field not in row:
                    problems.append(f"step_cost: {task}/{name} lacks {field}")
            if row.get("baseline") and not isinstance(row.get("ratio"), float):
                problems.append(f"step_cost: {task}/{name} has no ratio")
            captured = row.get("captured")
            if captured is not None and not (
                    isinstance(captured, dict) and "label" in captured
                    and ("median_ms" in captured) != ("error" in captured)):
                problems.append(f"step_cost: {task}/{name} has a malformed captured entry")
        if not entry.get("configs"):
            problems.append(f"step_cost: {task} has no configurations")
    return problems


def validate(result: dict[str, Any]) -> list[str]:
    """Problems with a result (empty: it is well formed)."""
    problems = [f"missing {k}" for k in ("device", "date", "environment", "stages", "seconds")
                if k not in result]
    stages = result.get("stages", {})
    for name in stages:
        if name not in STAGE_NAMES:
            problems.append(f"unknown stage {name}")
    for name, stage in stages.items():
        if not _status_ok(stage.get("status")):
            problems.append(f"{name}: bad status {stage.get('status')!r}")
        if "seconds" not in stage:
            problems.append(f"{name}: no seconds")
        detail = stage.get("detail")
        if stage.get("status") == "passed" and name == "kernels":
            problems += _kernels(detail or {})
        if stage.get("status") == "passed" and name == "step_cost":
            problems += _step_cost(detail or {})
    return problems
