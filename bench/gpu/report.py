"""docs/cuda-kernels.md's GPU section, rendered from the committed GPU runs.

Every ``bench/results/gpu-*.json`` written by ``bench/gpu/run.py`` on a GPU (dry runs are
ignored) is one run. The section between the ``gpu-results`` markers lists the runs and
what each stage found, the kernel comparisons and the step costs of the newest run that
has them; with no run committed it says so.

    python bench/gpu/report.py --write docs/cuda-kernels.md   # after committing a run
    python bench/gpu/report.py --check docs/cuda-kernels.md   # the test: up to date?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
BEGIN = "<!-- gpu-results:begin (bench/gpu/report.py writes this part) -->"
END = "<!-- gpu-results:end -->"

SAME_PRECISION = {"conv_covariance": "unfold_matmul_fp32", "covariance": "xtx_fp32",
                  "precondition": "four_matmuls_fp32", "eigh": "torch_batched"}
"""Each group's alternative computed at kaisa's own precision (no TF32)."""


def load_runs(folder: Path = RESULTS) -> list[tuple[str, dict[str, Any]]]:
    """The committed GPU runs, oldest first: (file name, result)."""
    runs = []
    for path in sorted(folder.glob("gpu-*.json")):
        result = json.loads(path.read_text())
        if not result.get("dry_run"):
            runs.append((path.name, result))
    return sorted(runs, key=lambda r: (r[1].get("started_utc", ""), r[0]))


def _stage(result: dict[str, Any], name: str) -> str:
    stage = result["stages"].get(name)
    return stage["status"] if stage else "not run"


def runs_table(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """One row per run: the device, software and each stage's status."""
    names = ("build", "tests", "sanitizer", "kernels", "step_cost")
    lines = ["| run | device | driver | torch | " + " | ".join(names) + " |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for file, r in runs:
        env = r.get("environment", {})
        lines.append(f"| `{file}` | {r['device']} | {env.get('driver')} | {env.get('torch')} | "
                     + " | ".join(_stage(r, n) for n in names) + " |")
    return lines


def _newest(runs: list[tuple[str, dict[str, Any]]], stage: str,
            key: str) -> tuple[str, dict[str, Any]] | None:
    for file, r in reversed(runs):
        detail = (r["stages"].get(stage) or {}).get("detail") or {}
        if detail.get(key):
            return file, detail
    return None


def kernel_summary(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Per kernel group: rows, kaisa against the best and the same-precision alternative
    (median, min, max of the ratio alternative / kaisa), and the median gap to the floor."""
    found = _newest(runs, "kernels", "results")
    if found is None:
        return ["No kernel benchmark has run on a GPU."]
    file, detail = found
    c = detail.get("ceilings", {})
    lines = [f"From `{file}`. Measured ceilings: copy {c.get('copy_gbs', 0):.0f} GB/s; matmul "
             f"fp32 {c.get('fp32_tflops', 0):.0f}, TF32 {c.get('tf32_tflops', 0):.0f}, bf16 "
             f"{c.get('bf16_tflops', 0):.0f}, fp64 {c.get('fp64_tflops', 0):.0f} TFLOP/s. "
             "Speedup = alternative's time / kaisa's (above 1: kaisa faster); gap = kaisa's "
             "time / its floor.", "",
             "| kernel | rows | vs best alternative: median (min-max) | vs same precision: "
             "median (min-max) | gap to floor: median |", "| --- | --- | --- | --- | --- |"]

    def spread(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"

    for group, rows in detail["results"].items():
        if group == "syevj_knee":
            continue
        rows = {k: v for k, v in rows.items() if not k.startswith("whole-set")}
        best = [r["speedup_vs_best"] for r in rows.values()]
        same_name = SAME_PRECISION.get(group, "")
        same = [r["ms"][same_name] / r["ms"]["kaisa"] for r in rows.values()
                if same_name in r["ms"]]
        gaps = [r["gap"] for r in rows.values() if "gap" in r]
        lines.append(f"| `{group}` | {len(rows)} | {spread(best)} | {spread(same)} "
                     f"(`{same_name}`) | {statistics.median(gaps):.1f} |" if gaps else "")
    for key in ("whole-set-float32", "whole-set-float64"):
        row = detail["results"].get("eigh", {}).get(key)
        if row:
            ms = ", ".join(f"{k} {v:.0f} ms" for k, v in row["ms"].items())
            lines.append(f"\nResNet-50's whole factor set ({row['factors']} factors, "
                         f"{key.split('-')[-1]}): {ms}.")
    knee = detail["results"].get("syevj_knee")
    if knee:
        lines.append("\nThe syevj knee (batches of 64, each routine forced): fastest "
                     + ", ".join(f"{k.split('-')[0][1:]}: {v['fastest']}"
                                 for k, v in sorted(knee["sizes"].items(),
                                                    key=lambda kv: int(kv[0][1:].split('-')[0])))
                     + f"; measured `KAISA_SYEVJ_MAX_N` = {knee['measured_knee_n']} "
                     f"(default {knee['default_n']}).")
    return lines


def step_costs(runs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The newest measured step costs, per task and configuration."""
    found = _newest(runs, "step_cost", "tasks")
    if found is None:
        return ["No step cost has been measured on a GPU."]
    file, detail = found
    lines = [f"From `{file}`:", "",
             "| task | configuration | ms / step | ratio | vs | per label: median ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for task, entry in detail["tasks"].items():
        if "error" in entry:
            lines.append(f"| {task} | {entry['error'][:100]} | | | | |")
            continue
        for name, row in entry["configs"].items():
            labels = ", ".join(f"{k} {v['median_ms']:.1f}" for k, v in row["labels"].items())
            ratio = f"{row['ratio']:.2f}x" if row["ratio"] else ""
            lines.append(f"| {task} | {name} | {row['ms_per_step']:.1f} | {ratio} | "
                         f"{row['baseline'] or ''} | {labels} |")
    return lines


def render_docs(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """The whole generated section (without the markers)."""
    if not runs:
        return "\nNever run on a GPU: no `bench/results/gpu-*.json` is committed.\n"
    parts = ["", "### The runs", "", *runs_table(runs), "",
             "### Kernels against the alternatives", "", *kernel_summary(runs), "",
             "### Step cost on the GPU", "", *step_costs(runs), ""]
    return "\n".join(p for p in parts if p is not None) + "\n"


def splice(doc: str, section: str) -> str:
    """``doc`` with the text between the markers replaced by ``section``."""
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Writes or checks the section in the given markdown file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", type=Path)
    mode.add_argument("--check", type=Path)
    args = parser.parse_args(argv)
    path = args.write or args.check
    doc = path.read_text()
    new = splice(doc, render_docs(load_runs()))
    if args.write:
        path.write_text(new)
        return 0
    if new != doc:
        print(f"{path} is out of date: python bench/gpu/report.py --write {path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
