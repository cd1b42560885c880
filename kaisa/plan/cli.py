"""``python -m kaisa.plan``: plan models over world sizes, fractions and intervals."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from kaisa.plan.compute import ComputeProfile, load_profile, microbenchmark
from kaisa.plan.iteration import IterationModel, PlanConfig, StepCost
from kaisa.plan.network import PRESETS, parse_network
from kaisa.plan.report import format_table, plot_curves
from kaisa.plan.search import recommend
from kaisa.plan.workload import load_workload

__all__ = ["main", "parse_args"]

#: Local batch per rank of the built-in models when ``--batch`` is not given.
DEFAULT_BATCH = {"resnet50": 32, "bert-large": 8}


def _worlds(text: str) -> list[int]:
    worlds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if sep:
            w = int(lo)
            while w <= int(hi):
                worlds.append(w)
                w *= 2
        else:
            worlds.append(int(part))
    if not worlds or min(worlds) < 1 or max(worlds) > 1024:
        raise argparse.ArgumentTypeError(f"world sizes must be in 1..1024, got {text!r}")
    return worlds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m kaisa.plan",
        description="Predict K-FAC iteration time by phase and memory per rank for every "
                    "world size and grad_worker_fraction, and recommend a configuration.")
    p.add_argument("--model", action="append", default=None,
                   help="resnet50, bert-large or module:callable (repeatable; default both)")
    p.add_argument("--world", type=_worlds, default=_worlds("8-256"),
                   help="world sizes: '8,16,64' or a doubling range '8-256' (default 8-256)")
    p.add_argument("--network", default="a100-ib",
                   help=f"spec such as '8x900GB/s,4x200Gb/s@5us' or a preset: "
                        f"{', '.join(PRESETS)} (default a100-ib)")
    p.add_argument("--profile", help="compute profile JSON: the GPU script's result "
                                     "(bench/results/gpu-*.json) or one --save-profile wrote")
    p.add_argument("--device", default="cpu", help="device of the microbenchmark (no --profile)")
    p.add_argument("--save-profile", help="write the compute profile used to this JSON")
    p.add_argument("--step-ms", type=float, help="measured first-order iteration (ms)")
    p.add_argument("--batch", type=int, help="local batch per rank (default 32 images, 8 seqs)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--memory-budget-mb", type=float)
    p.add_argument("--overhead-target", type=float, default=0.1)
    p.add_argument("--factor-steps", type=int, default=10, help="factor_update_steps of the table")
    p.add_argument("--inv-steps", type=int, default=100, help="inv_update_steps of the table")
    p.add_argument("--compute-method", default="eigen", choices=("eigen", "inverse"))
    p.add_argument("--symmetry-aware", action="store_true")
    p.add_argument("--plot", help="write the curves (PNG) here")
    p.add_argument("--json", help="write every prediction here")
    return p.parse_args(argv)


def _profile(args: argparse.Namespace) -> ComputeProfile:
    profile = load_profile(args.profile) if args.profile else microbenchmark(args.device)
    if args.step_ms is not None:
        profile = ComputeProfile(**{**profile.__dict__, "step_s": args.step_ms / 1e3})
    if args.save_profile:
        with open(args.save_profile, "w", encoding="utf-8") as fh:
            json.dump(profile.to_json(), fh, indent=1)
    return profile


def _record(c: StepCost, fac: int, inv: int) -> dict[str, Any]:
    return {"world_size": c.grid.world_size, "fraction": str(c.grid.fraction),
            "strategy": c.grid.strategy_name, "phases_s": dict(c.phases),
            "iteration_s": c.iteration(fac, inv), "total_s": c.total(fac, inv),
            "overhead": c.overhead(fac, inv), "memory_mb": c.memory_mb}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the planner; prints the tables and recommendations."""
    start = time.perf_counter()
    args = parse_args(argv)
    net = parse_network(args.network)
    profile = _profile(args)
    config = PlanConfig(compute_method=args.compute_method, symmetry_aware=args.symmetry_aware)
    print(f"network  {net.describe()}")
    print(f"compute  {profile.device} ({profile.source}): covariance "
          f"{profile.covariance.rate / 1e12:.3g} TFLOP/s, precondition "
          f"{profile.precondition.rate / 1e12:.3g} TFLOP/s, eigh n=1024 "
          f"{profile.eigh_s(1024) * 1e3:.3g} ms")
    curves: dict[str, dict[int, list[StepCost]]] = {}
    out: dict[str, Any] = {"network": net.describe(), "profile": profile.to_json(), "models": {}}
    for name in args.model or ["resnet50", "bert-large"]:
        t0 = time.perf_counter()
        batch = args.batch or DEFAULT_BATCH.get(name, 32)
        workload = load_workload(name, batch=batch, seq_len=args.seq_len)
        model = IterationModel(workload=workload, compute=profile, network=net, config=config)
        sweeps = {w: model.sweep(w) for w in args.world}
        curves[name] = sweeps
        print(f"\n== {name}: {len(workload.blocks)} K-FAC blocks, local batch {batch}, "
              f"first-order step {model.first_order_seconds() * 1e3:.1f} ms")
        print(format_table(sweeps, factor_update_steps=args.factor_steps,
                           inv_update_steps=args.inv_steps,
                           memory_budget_mb=args.memory_budget_mb))
        print(f"recommended (budget {args.memory_budget_mb} MB, overhead target "
              f"{args.overhead_target:.0%}):")
        recs = []
        for w, costs in sweeps.items():
            rec = recommend(costs, memory_budget_mb=args.memory_budget_mb,
                            overhead_target=args.overhead_target)
            print("  " + (rec.describe() if rec else f"world {w}: no fraction fits the budget"))
            recs.append(None if rec is None else {**rec.__dict__, "fraction": str(rec.fraction)})
        out["models"][name] = {
            "rows": [_record(c, args.factor_steps, args.inv_steps)
                     for costs in sweeps.values() for c in costs],
            "recommendations": recs}
        print(f"({name} planned in {time.perf_counter() - t0:.1f} s)")
    if args.plot:
        plot_curves(curves, args.plot, factor_update_steps=args.factor_steps,
                    inv_update_steps=args.inv_steps)
        print(f"\ncurves written to {args.plot}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    print(f"planned in {time.perf_counter() - start:.1f} s")
    return 0
