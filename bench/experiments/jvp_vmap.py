"""The quadratic model's two ``J v`` in one forward-mode pass (``torch.func.vmap`` over the
tangents) against two replays with dual numbers (what ``kaisa.KFAC`` runs).

    python bench/experiments/jvp_vmap.py [--iters 8]

On ``bench/step_cost/step_cost.py``'s autoencoder (784-...-6, batch 256) and byte GPT (d 128, 4
layers, context 64, batch 32), one thread, random tangents: median milliseconds of a plain
forward pass (no grad), of two dual-number passes, and of one ``vmap(jvp)`` pass over both
tangents, interleaved; and the largest difference of their ``J v``. Prints JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.autograd.forward_ad as fwad
from torch import nn
from torch.func import functional_call, jvp, vmap

from kaisa.kfac.replay import RandomState, replayed
from kaisa.train import models
from kaisa.train.models.gpt import gpt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness


def _task(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name == "autoencoder":
        return models.autoencoder(input_dim=784, hidden_dims=(400, 200, 100, 50, 25, 6)), \
            torch.rand(256, 784)
    return gpt(d_model=128, n_layers=4, context=64, n_heads=4), torch.randint(0, 256, (32, 64))


def measure(name: str, iters: int) -> dict[str, Any]:
    """Median ms of each way and the largest difference of their products."""
    model, x = _task(name)
    params = {n: p.detach() for n, p in model.named_parameters()}
    tangents = [{n: torch.randn_like(p) for n, p in params.items()} for _ in range(2)]
    stacked = {n: torch.stack([t[n] for t in tangents]) for n in params}
    start = RandomState.capture()

    def f(values: dict[str, torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = functional_call(model, values, (x,))
        return out

    def plain() -> list[torch.Tensor]:
        with torch.no_grad():
            return [f(params)]

    def dual() -> list[torch.Tensor]:
        out = []
        for t in tangents:
            with torch.no_grad(), replayed(model, start), fwad.dual_level():
                duals = {n: fwad.make_dual(params[n], t[n])  # type: ignore[no-untyped-call]
                         for n in params}
                out.append(fwad.unpack_dual(f(duals))[1])  # type: ignore[no-untyped-call]
        return out

    def batched() -> list[torch.Tensor]:
        with torch.no_grad(), replayed(model, start):
            both = vmap(lambda t: jvp(f, (params,), (t,))[1], randomness="same")(stacked)
        return list(both)

    ways: dict[str, Callable[[], list[torch.Tensor]]] = {
        "forward_no_grad": plain, "two_dual_passes": dual, "vmap_jvp": batched}
    times = harness.interleaved(ways, iters, warmup=1, rotate=False)
    diff = max(float((a - b).abs().max()) for a, b in zip(dual(), batched(), strict=True))
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return {"median_ms": {k: round(v, 1) for k, v in med.items()},
            "vmap_over_dual": round(med["vmap_jvp"] / med["two_dual_passes"], 3),
            "max_abs_difference": diff}


def main() -> None:
    """Both tasks; prints the JSON."""
    parser = harness.parser(__doc__)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--tasks", default="autoencoder,gpt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({t: measure(t, args.iters) for t in args.tasks.split(",")}, indent=1))


if __name__ == "__main__":
    main()
