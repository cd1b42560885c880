"""The GPU script's short table (markdown) from its JSON: ``render(result)``."""

from __future__ import annotations

from typing import Any


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return "" if v is None else str(v)


def stage_rows(result: dict[str, Any]) -> list[str]:
    """One line per stage: status, seconds and the headline of its detail."""
    lines = ["| stage | status | seconds | what |", "| --- | --- | --- | --- |"]
    for name, stage in result["stages"].items():
        d = stage.get("detail") or {}
        what = ""
        if name == "environment":
            what = f"{d.get('device', '')}, driver {d.get('driver')}, torch {d.get('torch')}"
        elif name == "build":
            cxx = (d.get("compiler") or {}).get("cxx") or "default c++"
            what = (f"arch {d.get('arch')}, {cxx}, {d.get('build_s', '-')} s, backend "
                    f"{d.get('backend')}" + (f", {d['error']}" if d.get("error") else "")
                    + (f", error path: {d['error_path']}" if "error_path" in d else ""))
        elif name == "tests":
            what = ", ".join(f"{d[k]} {k}" for k in (
                "collected", "passed", "failed", "error", "crashed", "skipped", "not_run")
                if d.get(k))
        elif name == "sanitizer":
            what = ", ".join(f"{t} {v.get('status')}" for t, v in d.get("tools", {}).items())
        elif name == "kernels":
            what = ", ".join(f"{k} {len(v)}" for k, v in d.get("results", {}).items())
        elif name == "step_cost":
            what = ", ".join(d.get("tasks", {}))
        lines.append(f"| {name} | {stage['status']} | {_fmt(stage.get('seconds'))} | {what} |")
    return lines


def kernel_rows(result: dict[str, Any]) -> list[str]:
    """Per kernel row: kaisa's ms, the best alternative's, the speedup, floor and gap."""
    detail = result["stages"].get("kernels", {}).get("detail") or {}
    results = detail.get("results", {})
    if not results:
        return []
    lines = ["", "| kernel | shape | kaisa ms | best alternative | ms | speedup | floor ms | gap |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for group, rows in results.items():
        if group == "syevj_knee":
            continue
        for key, row in rows.items():
            best = row.get("best_alternative", "")
            lines.append(
                f"| {group} | {key} | {_fmt(row['ms'].get('kaisa'))} | {best} | "
                f"{_fmt(row['ms'].get(best))} | {_fmt(row.get('speedup_vs_best'))} | "
                f"{_fmt(row.get('floor_ms'))} | {_fmt(row.get('gap'))} |")
    knee = results.get("syevj_knee")
    if knee:
        lines.append("\nsyevj knee: fastest routine per n: " + ", ".join(
            f"{k} {v['fastest']}" for k, v in knee["sizes"].items())
            + f"; measured knee n = {knee['measured_knee_n']} (default {knee['default_n']})")
    return lines


def step_rows(result: dict[str, Any]) -> list[str]:
    """Per task and configuration: ms per step, ratio to the baseline, peak memory, and the
    replay of its most frequent step captured in a CUDA graph (ms, ratio)."""
    detail = result["stages"].get("step_cost", {}).get("detail") or {}
    tasks = detail.get("tasks", {})
    if not tasks:
        return []
    lines = ["", "| task | configuration | ms / step | ratio | vs | peak GiB | captured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for task, entry in tasks.items():
        if "error" in entry:
            lines.append(f"| {task} | {entry['error'][:80]} | | | | | |")
            continue
        for name, row in entry["configs"].items():
            lines.append(f"| {task} | {name} | {_fmt(row['ms_per_step'])} | "
                         f"{_fmt(row['ratio'])} | {_fmt(row['baseline'])} | "
                         f"{_fmt(row['peak_gib'])} | {_captured(row.get('captured'))} |")
    return lines


def _captured(entry: dict[str, Any] | None) -> str:
    """``label: ms (ratio)`` of a captured step, or the first words of why not."""
    if not entry:
        return ""
    if "median_ms" in entry:
        ratio = f" ({_fmt(entry['ratio'])}x)" if "ratio" in entry else ""
        return f"{entry['label']}: {_fmt(entry['median_ms'])} ms{ratio}"
    return f"{entry['label']}: {entry['error'][:60]}"


def render(result: dict[str, Any]) -> str:
    """The whole table for ``result``."""
    head = (f"GPU script on {result['device']} ({result['date']}"
            f"{', dry run' if result.get('dry_run') else ''}): {result['seconds']} s "
            f"of {result.get('budget_s')} s")
    return "\n".join([head, "", *stage_rows(result), *kernel_rows(result),
                      *step_rows(result)]) + "\n"
