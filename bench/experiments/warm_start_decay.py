"""Epochs/time to training MSE 0.02 on the digits autoencoder: constant vs warm-start decay.

    python bench/experiments/warm_start_decay.py [--seeds 0 1] [--epochs 25]

Compares ``factor_decay=0.95`` with ``factor_decay=lambda s: min(0.95, (s + 1) / (s + 2))``
(a running mean until it reaches 0.95) for factors every step / inverses every 10 and
factors every 5 / inverses every 20. Single-threaded; prints one line per run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import kaisa
from kaisa.train.models import autoencoder

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


def run(decay: float | Callable[[int], float], fus: int, ius: int, seed: int, epochs: int,
        x: torch.Tensor) -> tuple[tuple[int, float] | None, float]:
    torch.manual_seed(seed)
    model = autoencoder(input_dim=64)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    pre = kaisa.KFACPreconditioner(model, factor_decay=decay, factor_update_steps=fus,
                                   inv_update_steps=ius, lr=0.3, damping=0.03)
    gen = torch.Generator().manual_seed(seed)
    elapsed, hit, mse = 0.0, None, float("nan")
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        start = time.perf_counter()
        for i in range(0, len(x), 128):
            xb = x[perm[i:i + 128]]
            opt.zero_grad()
            F.mse_loss(model(xb), xb).backward()
            pre.step()
            opt.step()
        elapsed += time.perf_counter() - start
        with torch.no_grad():
            mse = F.mse_loss(model(x), x).item()
        if hit is None and mse < 0.02:
            hit = (epoch + 1, round(elapsed, 2))
    return hit, mse


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.tensor(load_digits().data, dtype=torch.float32) / 16.0

    def warm(s: int) -> float:
        return min(0.95, (s + 1) / (s + 2))

    for seed in args.seeds:
        for fus, ius in ((1, 10), (5, 20)):
            for name, decay in (("rho=0.95", 0.95), ("warm start", warm)):
                hit, mse = run(decay, fus, ius, seed, args.epochs, x)
                print(f"seed {seed} factors/{fus} inverses/{ius} {name:10s}: "
                      f"(epoch, s) to MSE 0.02 = {hit}, final MSE {mse:.4f}", flush=True)


if __name__ == "__main__":
    main()
