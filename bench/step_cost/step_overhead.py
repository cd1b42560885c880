"""Per-iteration overhead of K-FAC over SGD (Foundation benchmark).

Median iteration time of SGD vs SGD+K-FAC (eigen, factors every step, inverses every
10 steps, batch 128) on a CIFAR-style ResNet-32 (32x32 inputs) and an MLP
784-1024-1024-10, on synthetic data, with the thread count fixed. Both configurations
run in the same process, interleaved iteration by iteration (``bench.harness``), so machine
noise hits them alike.

    python bench/step_cost/step_overhead.py [--threads 2] [--iters 20] [--backend ext|torch]

Writes ``bench/results/step_overhead[_<backend>].json``.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import ops
from kaisa.train import models

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


def _setups() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    return {
        "resnet32": (lambda: models.resnet32(num_classes=10), (3, 32, 32)),
        "mlp": (
            lambda: nn.Sequential(
                nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                nn.ReLU(), nn.Linear(1024, 10),
            ),
            (784,),
        ),
    }


def _iteration(
    build: Callable[[], nn.Module], shape: tuple[int, ...], batch: int, use_kfac: bool,
) -> tuple[Callable[[], None], kaisa.KFACPreconditioner | None]:
    """One training iteration of a fresh model (seed 0), and its preconditioner."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pre = (
        kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10, lr=0.1)
        if use_kfac else None
    )
    x = torch.randn(batch, *shape)
    y = torch.randint(0, 10, (batch,))

    def iteration() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return iteration, pre


def main() -> None:
    """Run the benchmark and write the JSON results."""
    parser = harness.parser(__doc__)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (>= 10 "
                        "so the inverse update is amortised as in training)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="resnet32,mlp")
    parser.add_argument("--backend", choices=["ext", "torch"], default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.backend:
        ops.set_backend(args.backend)
    results: dict[str, object] = {
        "backend": ops.backend(),
        "threads": args.threads,
        "batch": args.batch,
        "iters": args.iters,
        "config": "SGD momentum 0.9 vs SGD+K-FAC eigen, factors every step, inverses every 10",
        "models": {},
    }
    for name in args.models.split(","):
        build, shape = _setups()[name]
        sgd_iter, _ = _iteration(build, shape, args.batch, False)
        kfac_iter, pre = _iteration(build, shape, args.batch, True)
        assert pre is not None
        fns = {"sgd": sgd_iter, "kfac": kfac_iter}
        harness.interleaved(fns, 0, warmup=args.warmup)
        pre.reset_timings()
        times = harness.interleaved(fns, args.iters)
        sgd, kfac, phases = times["sgd"], times["kfac"], pre.timings
        sgd_med, kfac_med = statistics.median(sgd), statistics.median(kfac)
        entry = {
            "sgd_median_s": sgd_med,
            "kfac_median_s": kfac_med,
            "ratio": kfac_med / sgd_med,
            "kfac_mean_s": statistics.fmean(kfac),
            "ratio_of_means": statistics.fmean(kfac) / statistics.fmean(sgd),
            "kfac_phase_seconds_per_iter": {k: v / args.iters for k, v in phases.items()},
        }
        results["models"][name] = entry  # type: ignore[index]
        split = ", ".join(f"{k} {v / args.iters * 1e3:.0f} ms" for k, v in phases.items())
        print(f"{name:9s} SGD {sgd_med * 1e3:8.1f} ms  K-FAC {kfac_med * 1e3:8.1f} ms  "
              f"ratio {kfac_med / sgd_med:.2f}x  K-FAC phases, mean per iteration: {split}")
    out = args.out or harness.RESULTS / f"step_overhead_{ops.backend()}.json"
    harness.write(out, "step_overhead", results, script="bench/step_cost/step_overhead.py",
                  indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
