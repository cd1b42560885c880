"""Spread decompositions: an interval's longest decomposition step, by ``decomposition_spread``.

With ``decomposition_spread=1`` (kfac-pytorch's schedule) one step in ``inv_update_steps``
decomposes every factor: on an H100 that step took 1.9 s for ResNet-50 while a plain step
took 48 ms. ``decomposition_spread=k`` decomposes the blocks in ``k`` parts of about equal
cost, each on its own step of the interval (``docs/conventions.md``, "Spread
decompositions"). This script runs ``KFACPreconditioner`` on ResNet-50 (ImageNet's 1000
classes, 32 px inputs: the factors' sizes do not depend on the image size) for step 0 (every
block) and one whole interval after it, and times the decompositions of each step
(``update_decompositions``, wall clock): per ``k`` the longest step of the interval, the
interval's sum and the parts' predicted share of the work (``kaisa.core.schedule``'s cost,
``n^3`` per side).

    python bench/experiments/spread_decompositions.py  # bench/results/spread_decompositions.json
    python bench/experiments/spread_decompositions.py --smoke --out /tmp/s.json   # ResNet-20
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import kaisa
from bench import harness
from kaisa.core.schedule import block_cost


def _run(model_name: str, interval: int, spread: int) -> dict[str, Any]:
    from kaisa.train import models

    torch.manual_seed(0)
    model = models.resnet20(num_classes=10) if model_name == "resnet20" else models.resnet50()
    classes = 10 if model_name == "resnet20" else 1000
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=interval,
                                   inv_update_steps=interval, decomposition_spread=spread)
    curvature = pre.curvature
    update = curvature.update_decompositions
    seconds: dict[int, float] = {}

    def timed(damping: float, **kw: Any) -> None:
        start = time.perf_counter()
        update(damping, **kw)
        seconds[pre.steps] = time.perf_counter() - start

    curvature.update_decompositions = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(100)
    x = torch.randn(2, 3, 32, 32, generator=gen)
    y = torch.randint(0, classes, (2,), generator=gen)
    for _ in range(interval + 1):  # step 0 and one whole interval
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        pre.step()
    parts = curvature.decomposition_parts
    blocks = curvature.blocks
    total = sum(block_cost(b) for b in blocks.values())
    ms = {s: round(t * 1e3, 1) for s, t in sorted(seconds.items())}
    later = [t for s, t in ms.items() if s > 0]
    return {"spread": spread, "decomposition_ms_by_step": ms,
            "longest_step_ms": max(later), "interval_sum_ms": round(sum(later), 1),
            "step0_ms": ms[0], "steps_that_decompose": len(later),
            "part_cost_shares": [round(sum(block_cost(blocks[n]) for n in p) / total, 3)
                                 for p in parts]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Every spread on one model: the decomposition steps of an interval."""
    p = harness.parser(__doc__, harness.RESULTS / "spread_decompositions.json")
    p.add_argument("--smoke", action="store_true", help="ResNet-20 (CIFAR), interval 4")
    p.add_argument("--interval", type=int, default=10, help="inv_update_steps")
    p.add_argument("--spreads", type=int, nargs="+", default=[1, 2, 5, 10])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = "resnet20" if args.smoke else "resnet50"
    interval = 4 if args.smoke else args.interval
    spreads = [1, 2] if args.smoke else args.spreads
    runs = [_run(name, interval, k) for k in spreads]
    base = runs[0]["longest_step_ms"]
    for run in runs:
        run["longest_vs_spread_1"] = round(run["longest_step_ms"] / base, 3)
        print(f"spread {run['spread']:>2}: longest step {run['longest_step_ms']:9.1f} ms "
              f"({run['longest_vs_spread_1']:.3f}x), interval sum {run['interval_sum_ms']:9.1f}"
              f" ms, step 0 {run['step0_ms']:9.1f} ms, parts {run['part_cost_shares']}",
              flush=True)
    payload = {"model": name, "inv_update_steps": interval, "threads": args.threads,
               "runs": runs}
    return harness.write(args.out, "spread_decompositions", payload, argv)


if __name__ == "__main__":
    main()
