"""Convergence benchmark on digits: SGD vs AdamW vs SGD+K-FAC vs kaisa.KFAC.

Two tasks, each run through ``kaisa-train`` in-process (``--compare``, so every
configuration of a grid shares initial weights and data order):

* autoencode: the 64-256-128-64-16-64-128-256-64 tanh autoencoder, MSE, batch
  128, SGD momentum 0.9, K-FAC factors every step and inverses every 10 steps,
  a 10-second training-time budget per configuration. The target (``--target``) is
  0.02 on the metric ``kaisa-train`` judges by, the test MSE in eval mode at each
  epoch end (before the AlgoPerf-style headline it was the full-training-set MSE;
  early in training the two are within a few percent).
* classify: the small CNN, cross-entropy, batch 128, target 97% test accuracy.

Protocol: a small learning-rate grid per optimiser (plus damping, KL clip,
factor decay and momentum for K-FAC) with seed 0; the best configuration per
family (by time to target, then by best metric) is rerun with seeds 1 and 2.
The ``sgd+kfac-amortised`` family goes beyond the reference protocol: factors
every 5 (or 10) steps and inverses every 20 (or 50). Times are
training wall time (evaluation and checkpointing excluded), single-threaded.

    python bench/convergence/convergence.py            # full run, < 10 minutes on 2 cores
    python bench/convergence/convergence.py --quick    # smoke test, about a minute
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kaisa.train.cli import main as kaisa_train

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

RESULTS = harness.RESULTS


def grids(quick: bool) -> dict[str, dict[str, list[str]]]:
    """Configurations per task and optimiser family (``--compare`` syntax)."""
    if quick:
        return {
            "autoencode": {
                "sgd": ["sgd@lr=1.0"],
                "adamw": ["adamw@lr=0.003"],
                "sgd+kfac": ["sgd+kfac@lr=0.3@damping=0.03"],
                "kfac": [KFAC_AE],
            },
            "classify": {
                "sgd": ["sgd@lr=0.1"],
                "adamw": ["adamw@lr=0.01"],
                "sgd+kfac": ["sgd+kfac@lr=0.3@damping=0.1"],
                "kfac": [KFAC_CLS],
            },
        }
    kfac_ae = [  # factors every step, inverses every 10 steps (the reference protocol)
        "sgd+kfac@lr=0.1@damping=0.03",
        "sgd+kfac@lr=0.3@damping=0.03",  # kfac-pytorch's best setting
        "sgd+kfac@lr=0.3@damping=0.01",  # hypothesis: damping too large
        "sgd+kfac@lr=0.3@damping=0.1",
        "sgd+kfac@lr=1.0@damping=0.1",
        "sgd+kfac@lr=0.3@damping=0.03@kl-clip=0.01",  # hypothesis: KL clip limits the step
        "sgd+kfac@lr=0.03@damping=0.03@kl-clip=none",
        "sgd+kfac@lr=0.01@damping=0.01@kl-clip=none",
        "sgd+kfac@lr=0.3@damping=0.03@factor-decay=0.99",  # hypothesis: factor decay
        "sgd+kfac@lr=0.3@damping=0.03@momentum=0",
    ]
    amortised = "@factor-update-steps=5@inv-update-steps=20"
    return {
        "autoencode": {
            "sgd": [f"sgd@lr={lr}" for lr in (0.3, 1.0, 2.0)],
            "adamw": [f"adamw@lr={lr}" for lr in (0.001, 0.003, 0.01)],
            "sgd+kfac": kfac_ae,
            "sgd+kfac-amortised": [
                f"sgd+kfac@lr=0.3@damping=0.03{amortised}",
                "sgd+kfac@lr=0.3@damping=0.03@factor-update-steps=10@inv-update-steps=50",
            ],
            # kaisa.KFAC: adaptive lr/momentum/damping; the grid is its curvature settings
            # (explicit: the shared flags above would override the tuned defaults)
            "kfac": [
                f"{KFAC_AE}",  # the tuned default (pi_inverse)
                f"{KFAC_AE}".replace("inv-update-steps=1", "inv-update-steps=2"),
                f"{KFAC_AE}".replace("inv-update-steps=1", "inv-update-steps=10"),
                f"{KFAC_AE}@curvature=empirical",  # ablation: empirical Fisher
                f"{KFAC_AE}@adaptive-damping=false",  # ablation: no LM rule
                "kfac@damping=0.001@inv-update-steps=3@factor-decay=0.8",  # last default
                "kfac@damping=0.001@inv-update-steps=3@factor-decay=0.8@compute-method=eigen",
            ],
        },
        "classify": {
            "sgd": [f"sgd@lr={lr}" for lr in (0.03, 0.1, 0.2)],
            "adamw": [f"adamw@lr={lr}" for lr in (0.003, 0.01, 0.03)],
            "sgd+kfac": [
                "sgd+kfac@lr=0.1@damping=0.1",
                "sgd+kfac@lr=0.3@damping=0.1",
                "sgd+kfac@lr=0.3@damping=0.3",
                "sgd+kfac@lr=1.0@damping=0.3",
            ],
            "sgd+kfac-amortised": [f"sgd+kfac@lr=0.3@damping=0.1{amortised}"],
            "kfac": [
                f"{KFAC_CLS}",  # the tuned default
                f"{KFAC_CLS}".replace("damping=0.1", "damping=0.03"),
                f"{KFAC_CLS}".replace("pi_inverse", "eigen"),
                f"{KFAC_CLS}@curvature=empirical",
            ],
        },
    }


#: kaisa.KFAC's tuned settings per task (kaisa/train/configs.py), spelled out.
KFAC_AE = "kfac@damping=0.0001@inv-update-steps=1@factor-decay=0.8@compute-method=pi_inverse"
KFAC_CLS = "kfac@damping=0.1@inv-update-steps=3@factor-decay=0.8@compute-method=pi_inverse"
#: Further autoencoder milestones reported per seed (the issue's 0.01 target).
MILESTONES = (0.01, 0.0025)


def milestones(history: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """Epochs and training time to each of :data:`MILESTONES`, and the best within 60 epochs."""
    out: dict[str, Any] = {}
    for level in MILESTONES:
        hit = next((r for r in history if r.get(metric) is not None and r[metric] <= level), None)
        out[f"epochs_to_{level}"] = None if hit is None else hit["epoch"]
        out[f"time_to_{level}"] = None if hit is None else hit["time"]
    early = [r[metric] for r in history if r["epoch"] <= 60 and r.get(metric) is not None]
    out["best_within_60_epochs"] = min(early) if early else None
    return out


def cost_split(history: list[dict[str, Any]]) -> dict[str, float] | None:
    """Milliseconds per iteration by K-FAC phase, from the last epoch's cumulative timings."""
    last = history[-1] if history else None
    if last is None or not last.get("kfac") or not last.get("step"):
        return None
    split = {phase: 1e3 * seconds / last["step"] for phase, seconds in last["kfac"].items()}
    if last.get("seconds_per_iter"):  # forward and backward passes outside the hooks, update
        split["rest"] = 1e3 * last["seconds_per_iter"] - sum(split.values())
    return split


def task_args(task: str, quick: bool) -> list[str]:
    """Shared ``kaisa-train`` flags of a task."""
    common = [
        "--batch-size",
        "128",
        "--momentum",
        "0.9",
        "--kfac-factor-update-steps",
        "1",
        "--kfac-inv-update-steps",
        "10",
        "--threads",
        "1",
        "--quiet",
        "--no-plot",
    ]
    if task == "autoencode":
        budget = "2" if quick else "10"
        return [
            *common,
            "--task",
            "autoencode",
            "--target",
            "0.02",
            "--epochs",
            "100000",
            "--time-budget",
            budget,
        ]
    return [
        *common,
        "--task",
        "classify",
        "--model",
        "cnn",
        "--target",
        "0.97",
        "--epochs",
        "6" if quick else "20",
    ]


def run(task: str, configs: list[str], seed: int, quick: bool, workdir: Path) -> dict[str, Any]:
    """Run ``configs`` side by side with ``seed``; return summary rows and histories."""
    name = f"{task}-seed{seed}-{abs(hash(tuple(configs))) % 10**8}"
    argv = [
        *task_args(task, quick),
        "--compare",
        ",".join(configs),
        "--seed",
        str(seed),
        "--run-dir",
        str(workdir),
        "--name",
        name,
        "--overwrite",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        status = kaisa_train(argv)
    run_dir = workdir / name
    summary = json.loads((run_dir / "summary.json").read_text())
    histories: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("type") != "settings":  # the head holds each configuration's settings
            histories[record["config"]].append(record)
    return {
        "status": status,
        "rows": summary["configs"],
        "metric": summary["metric"],
        "histories": histories,
    }


def rank_key(row: dict[str, Any], metric: str, higher: bool) -> tuple[float, float]:
    """Sort key: time to target (unreached last), then best metric."""
    reach = row["time_to_target"] if row["time_to_target"] is not None else math.inf
    best = row[f"best_{metric}"]
    best = math.inf if best is None else (-best if higher else best)
    return reach, best


def bench_task(
    task: str, grid: dict[str, list[str]], seeds: int, quick: bool, workdir: Path
) -> dict[str, Any]:
    """Grid with seed 0, then the best configuration per optimiser with more seeds."""
    configs = [c for family in grid.values() for c in family]
    first = run(task, configs, 0, quick, workdir)
    metric, higher = first["metric"], task == "classify"
    rows = {row["config"]: row for row in first["rows"]}
    best = {
        family: min((rows[c] for c in members), key=lambda r: rank_key(r, metric, higher))["config"]
        for family, members in grid.items()
    }
    per_seed = {config: [rows[config]] for config in best.values()}
    histories = {config: first["histories"][config] for config in best.values()}
    seed_histories = {config: [first["histories"][config]] for config in best.values()}
    for seed in range(1, seeds):
        again = run(task, list(best.values()), seed, quick, workdir)
        for row in again["rows"]:
            per_seed[row["config"]].append(row)
            seed_histories[row["config"]].append(again["histories"][row["config"]])
    summary = {}
    for family, config in best.items():
        seeds_rows = per_seed[config]
        times = [r["time_to_target"] for r in seeds_rows]
        reached = [t for t in times if t is not None]
        summary[family] = {
            "config": config,
            "seeds": len(seeds_rows),
            "reached_target": f"{len(reached)}/{len(times)}",
            "time_to_target_median": statistics.median(reached) if reached else None,
            "time_to_target_all": times,
            "epochs_to_target_all": [r["epochs_to_target"] for r in seeds_rows],
            f"best_{metric}_median": statistics.median(r[f"best_{metric}"] for r in seeds_rows),
            f"best_{metric}_all": [r[f"best_{metric}"] for r in seeds_rows],
            "seconds_per_iter_median": statistics.median(r["seconds_per_iter"] for r in seeds_rows),
            "epochs_run_all": [r["epochs"] for r in seeds_rows],
            "cost_split_ms_per_iter_seed0": cost_split(histories[config]),
        }
        if task == "autoencode":
            summary[family]["milestones_all"] = [
                milestones(h, metric) for h in seed_histories[config]
            ]
    grid_rows = [{k: v for k, v in row.items() if k != "init_checksum"} for row in first["rows"]]
    if task == "autoencode":
        for row in grid_rows:
            row.update(milestones(first["histories"][row["config"]], metric))
    for row in grid_rows:
        row["cost_split_ms_per_iter"] = cost_split(first["histories"][row["config"]])
    return {"metric": metric, "grid_seed0": grid_rows, "best": summary, "histories": histories}


def plot(results: dict[str, Any], path: Path) -> None:
    """Metric against training time for the best configuration of each optimiser (seed 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        data = results["tasks"][task]
        metric = data["metric"]
        for family, info in data["best"].items():
            history = data["histories"][info["config"]]
            points = [(r["time"], r[metric]) for r in history if r.get(metric) is not None]
            axis.plot(*zip(*points, strict=True), label=f"{family}: {info['config']}")
        axis.axhline(results["protocol"][task]["target"], color="grey", linestyle="--")
        if task == "autoencode":
            axis.set_yscale("log")
        else:
            axis.set_ylim(0.8, 1.0)
        axis.set_xlabel("training wall time (s)")
        axis.set_ylabel(metric.replace("_", " "))
        axis.set_title(f"digits {task} (seed 0, best per optimiser)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="upper right" if task == "autoencode" else "lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = harness.parser(__doc__, RESULTS / "convergence.json")
    parser.add_argument("--quick", action="store_true", help="tiny grid, 1 seed, short budget")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    seeds = 1 if args.quick else args.seeds
    os.environ.setdefault("KAISA_BACKEND", "torch")
    started = time.perf_counter()
    load_average_start = list(os.getloadavg())
    results: dict[str, Any] = {
        "protocol": {
            "autoencode": {
                "target": 0.02,
                "metric": "full-train MSE (eval mode) at epoch end",
                "budget_s": 2 if args.quick else 10,
                "batch_size": 128,
            },
            "classify": {
                "target": 0.97,
                "metric": "test accuracy at epoch end",
                "epochs": 6 if args.quick else 20,
                "batch_size": 128,
            },
            "kfac": {
                "sgd+kfac": {"factor_update_steps": 1, "inv_update_steps": 10,
                             "factor_decay": 0.95},
                "kaisa.KFAC": {"autoencode": KFAC_AE, "classify": KFAC_CLS},
            },
            "seeds": seeds,
            "quick": args.quick,
        },
        "tasks": {},
    }
    with tempfile.TemporaryDirectory() as workdir:
        for task, grid in grids(args.quick).items():
            results["tasks"][task] = bench_task(task, grid, seeds, args.quick, Path(workdir))
            for family, info in results["tasks"][task]["best"].items():
                print(f"{task:10s} {family:9s} {json.dumps(info)}", flush=True)
    results["bench_wall_s"] = time.perf_counter() - started
    results = harness.write(args.out, "convergence", results,
                            script="bench/convergence/convergence.py", threads=1,
                            load_average_start=load_average_start)
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {results['bench_wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
