"""Refits the covariance cost model's constants to a GPU run's forced-path timings.

The model (``choose_covariance`` in ``csrc/cuda/covariance.cu``; docs/cuda-kernels.md):

    fused = 2 rows pairs 64^2 / (e_fused simt) + L
    gemm  = 2 rows d^2 / (e_gemm peak) + [packing] 2 rows d bytes / (0.8 HBM)
            + (2 if packing else 1) L + L

with the datasheet peaks (SIMT fp32 67, TF32 495, 16-bit 990 TFLOP/s; HBM 3.35 TB/s).
``bench/kernels/bench_kernels_gpu.py`` times each path forced (``paths_ms``: ``fused``,
``gemm_ieee``, ``gemm_tf32``) on ResNet-50's convolutions (fp32 and bf16) and linear
shapes. This fits the efficiencies (fused; GEMM for IEEE fp32, TF32 and 16-bit inputs)
and the per-call overhead ``L`` by least squares on the log of the times over a grid,
then reports how often each set of constants picks the faster path and the total time of
the paths it picks against always picking the faster one.

    python bench/gpu/fit_cost_model.py bench/results/gpu-nvidia-h100-80gb-hbm3-2026-11-27.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SIMT, TF32, TENSOR16, HBM = 67e12, 495e12, 990e12, 3.35e12
OLD = {"fused": 0.5, "ieee": 0.6, "tf32": 0.6, "b16": 0.6, "launch": 4e-6}
GRID = {"fused": (0.15, 0.18, 0.2, 0.22, 0.25), "ieee": (0.5, 0.6, 0.65, 0.7, 0.75),
        "tf32": (0.2, 0.25, 0.3, 0.35), "b16": (0.15, 0.2, 0.25, 0.3),
        "launch": (4e-6, 8e-6, 15e-6, 25e-6, 40e-6)}


@dataclass(frozen=True)
class Row:
    """One timed shape: its rows, d, input dtype, whether packed, and the forced times."""

    key: str
    rows: int
    d: int
    bf16: bool
    pack: bool
    ms: dict[str, float]


def rows_of(result: dict[str, Any]) -> list[Row]:
    """The forced-path timings of a GPU run's kernel stage."""
    kernels = result["stages"]["kernels"]["detail"]["results"]
    out = [Row(k, r["rows"], r["d"], k.endswith("bfloat16"), True, r["paths_ms"])
           for k, r in kernels["conv_covariance"].items()]
    out += [Row(k, r["rows"], r["d"], False, False, r["paths_ms"])
            for k, r in kernels["covariance"].items()]
    return out


def predict(r: Row, c: dict[str, float], tf32: bool) -> tuple[float, float]:
    """The model's (fused, gemm) seconds for ``r`` under constants ``c``."""
    tiles = math.ceil(r.d / 64)
    fused = 2 * r.rows * tiles * (tiles + 1) / 2 * 64 * 64 / (c["fused"] * SIMT) + c["launch"]
    peak, eff = ((TENSOR16, c["b16"]) if r.bf16 else (TF32, c["tf32"]) if tf32
                 else (SIMT, c["ieee"]))
    elem = 2 if r.bf16 else 4
    gemm = (2 * r.rows * r.d * r.d / (eff * peak)
            + (2 * r.rows * r.d * elem / (0.8 * HBM) if r.pack else 0.0)
            + (3 if r.pack else 2) * c["launch"])
    return fused, gemm


def measured(r: Row, tf32: bool) -> tuple[float, float]:
    """The run's (fused, gemm) seconds for ``r``."""
    return r.ms["fused"] * 1e-3, r.ms["gemm_tf32" if tf32 else "gemm_ieee"] * 1e-3


def cases(rows: list[Row]) -> list[tuple[Row, bool]]:
    """Each row under IEEE fp32, and fp32 rows under TF32 too."""
    return [(r, tf32) for r in rows for tf32 in ((False, True) if not r.bf16 else (False,))]


def loss(rows: list[Row], c: dict[str, float]) -> float:
    """Sum of squared log errors of both paths' predictions."""
    total = 0.0
    for r, tf32 in cases(rows):
        for p, m in zip(predict(r, c, tf32), measured(r, tf32), strict=True):
            total += math.log(p / m) ** 2
    return total


def decisions(rows: list[Row], c: dict[str, float]) -> dict[str, Any]:
    """How often ``c`` picks the faster path, and the picked paths' total time (ms)."""
    right, picked, best = 0, 0.0, 0.0
    for r, tf32 in cases(rows):
        pf, pg = predict(r, c, tf32)
        mf, mg = measured(r, tf32)
        right += (pg < pf) == (mg < mf)
        picked += mg if pg < pf else mf
        best += min(mf, mg)
    n = len(cases(rows))
    return {"right": f"{right}/{n}", "picked_ms": round(1e3 * picked, 2),
            "fastest_ms": round(1e3 * best, 2)}


def fit(rows: list[Row]) -> dict[str, float]:
    """The grid point with the least squared log error."""
    keys = list(GRID)
    points = (dict(zip(keys, values, strict=True)) for values in itertools.product(*GRID.values()))
    return min(points, key=lambda c: loss(rows, c))


def main(argv: list[str] | None = None) -> int:
    """Prints the fitted constants and both sets' decisions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a GPU run's JSON (bench/results/gpu-*.json)")
    args = parser.parse_args(argv)
    rows = rows_of(json.loads(args.run.read_text()))
    new = fit(rows)
    print(json.dumps({"shapes": len(rows), "old": {"constants": OLD, **decisions(rows, OLD)},
                      "fitted": {"constants": new, **decisions(rows, new)}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
