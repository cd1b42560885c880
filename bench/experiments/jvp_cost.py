"""Step cost of ``kaisa.KFAC``'s two ways to get ``J v``: forward mode against double backward.

    python bench/experiments/jvp_cost.py [--iters-mlp 60] [--iters-resnet 12]

Builds the same model twice (digits-shaped autoencoder, batch 128; CIFAR ResNet-20, batch
32), one ``kaisa.KFAC`` with ``jvp='forward'`` and one with ``jvp='double_backward'``, and
steps them alternately on the same batch (one thread); reports the median step time of
each, the ratio of medians (forward / double backward) and the per-phase split, and writes
``bench/results/jvp_cost.json``. The first 3 steps of each are warm-up.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import kaisa
from kaisa.train import models

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


def _build(name: str, jvp: str) -> tuple[Any, torch.Tensor, torch.Tensor, kaisa.KFAC]:
    torch.manual_seed(0)
    if name == "autoencoder":
        model = models.build_model("autoencoder", input_dim=64)
        x = torch.randn(128, 64)
        return model, x, x, kaisa.KFAC(model, loss="mse", jvp=jvp)
    model = models.resnet20(num_classes=10)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return model, x, y, kaisa.KFAC(model, loss="cross_entropy", jvp=jvp)


def _step(model: Any, x: torch.Tensor, t: torch.Tensor, opt: kaisa.KFAC) -> None:
    opt.step(lambda: (model(x), t))


def measure(name: str, iters: int) -> dict[str, Any]:
    """Median step times of both ways, interleaved."""
    runs = {jvp: _build(name, jvp) for jvp in ("forward", "double_backward")}
    steps = {jvp: functools.partial(_step, *run) for jvp, run in runs.items()}
    times = harness.interleaved(steps, iters, rotate=False)
    med = {jvp: statistics.median(v[3:]) for jvp, v in times.items()}
    return {
        "median_ms": {jvp: round(1e3 * v, 2) for jvp, v in med.items()},
        "ratio_forward_over_double_backward": round(med["forward"] / med["double_backward"], 3),
        "phases_ms_per_step": {
            jvp: {k: round(1e3 * v / iters, 2) for k, v in opt.timings.items()}
            for jvp, (_, _, _, opt) in runs.items()
        },
    }


def main(argv: list[str] | None = None) -> None:
    """Measures both models and writes the JSON."""
    parser = harness.parser(__doc__, harness.RESULTS / "jvp_cost.json")
    parser.add_argument("--iters-mlp", type=int, default=60)
    parser.add_argument("--iters-resnet", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"autoencoder": measure("autoencoder", args.iters_mlp),
              "resnet20": measure("resnet20", args.iters_resnet)}
    print(json.dumps(result, indent=1))
    harness.write(args.out, "jvp_cost", result, argv, script="bench/experiments/jvp_cost.py")


if __name__ == "__main__":
    main()
