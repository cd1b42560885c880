"""pytest configuration of the benchmarks: adds ext/reference ratios to the JSON."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

_LOAD_AT_START: tuple[float, float, float] = os.getloadavg()


def pytest_benchmark_update_json(config: Any, benchmarks: Any, output_json: dict[str, Any]) -> None:
    """Adds ``kaisa_summary``: per group, median times and reference/ext speedup."""
    medians: dict[str, dict[str, float]] = {}
    for bench in output_json.get("benchmarks", []):
        impl = bench.get("extra_info", {}).get("impl")
        group = bench.get("group")
        if impl in ("ext", "reference") and group:
            medians.setdefault(group, {})[impl] = float(bench["stats"]["median"])
    summary: dict[str, Any] = {}
    for group, m in sorted(medians.items()):
        entry: dict[str, Any] = {f"median_s_{k}": v for k, v in m.items()}
        if "ext" in m and "reference" in m and m["ext"] > 0:
            entry["speedup_reference_over_ext"] = m["reference"] / m["ext"]
        summary[group] = entry
    output_json["kaisa_summary"] = summary
    output_json["kaisa_environment"] = harness.environment(loadavg_start=list(_LOAD_AT_START))


def pytest_runtest_setup(item: Any) -> None:
    """With a CUDA device, GPU benchmarks fail (never skip) when the CUDA kernels are missing."""
    import pytest

    import kaisa.ops

    if "gpu" in item.keywords and torch.cuda.is_available():
        problem = kaisa.ops.cuda_kernels_error()
        if problem is not None:
            pytest.fail(f"CUDA device present but {problem}", pytrace=False)
