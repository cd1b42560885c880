"""Would a "linearize" (one primal pass, then the linear map per vector) cut ``kaisa.KFAC``'s
step? Its quadratic model needs ``J v`` for two vectors; today two forward-mode replays.

    python bench/experiments/jvp_linearize.py [--iters 6] [--tasks autoencoder,gpt]
    python bench/experiments/jvp_linearize.py --smoke --out /tmp/jvp_linearize.json  # tiny

On ``bench/step_cost/step_cost.py``'s autoencoder (784-...-6, batch 256) and byte GPT (d 128, 4
layers, context 64, batch 32), one thread, random tangents, interleaved iteration by
iteration, median milliseconds of:

* ``kfac_step``: a whole ``kaisa.KFAC`` adaptive step (defaults) on the same model and
  batch, and its ``jacobian_vector_products`` phase (the denominator of the projections);
* ``forward_no_grad``: a plain forward pass (what any linearize must still run once);
* ``two_dual_passes``: today's :class:`kaisa.kfac.quadratic.ForwardLinearization`, two vectors;
* ``func_linearize``: ``torch.func.linearize`` (``make_fx`` trace of the dual forward,
  constant folding) plus its linear map on both vectors, inside the same replay context;
  re-traced every step because the parameters (folded into the graph as constants) change;
  split into ``func_linearize_trace`` and ``func_linearize_apply``;
* ``cached_linear_map``: ``forward_no_grad`` plus the linear map of a graph traced once
  before timing (the cost if the trace could be reused across steps; a bound, not a way:
  the closure's batch and the parameters are constants of that graph);
* ``vmap_jvp``: one ``vmap(jvp)`` pass over both tangents (primal once, tangents batched).

For each, ``projected_kfac_step_saving`` = (``two_dual_passes`` - the way) / ``kfac_step``:
the fraction of the step it would remove. Also probes whether forward-mode AD nests
(a second ``dual_level``, a dual of a dual) and takes a complex tangent for a real primal
(``J (v1 + i v2)`` in one pass), and checks float64 ``J v`` of ``func_linearize`` against
today's path. Writes ``bench/results/jvp_linearize.json`` (``--out`` elsewhere).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp, linearize, vmap

import kaisa
from kaisa.kfac.quadratic import ForwardLinearization
from kaisa.kfac.replay import RandomState, replayed
from kaisa.train import models
from kaisa.train.models.gpt import gpt
from kaisa.utils.profiling import PhaseProfile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

RESULTS = harness.RESULTS
Task = tuple[nn.Module, torch.Tensor, torch.Tensor, str]


def _task(name: str, smoke: bool, dtype: torch.dtype = torch.float32) -> Task:
    """Model, input, target and loss name, built from seed 0."""
    torch.manual_seed(0)
    if name == "autoencoder":
        dims, hidden, batch = (32, (16, 8), 16) if smoke else (784, (400, 200, 100, 50, 25, 6), 256)
        model = models.autoencoder(input_dim=dims, hidden_dims=hidden).to(dtype)
        x = torch.rand(batch, dims, dtype=dtype)
        return model, x, x, "mse"
    sizes, batch = (dict(d_model=32, n_layers=2, context=16, n_heads=4), 4) if smoke else (
        dict(d_model=128, n_layers=4, context=64, n_heads=4), 32)
    lm: nn.Module = gpt(**sizes).to(dtype)
    tokens = torch.randint(0, 256, (batch, int(sizes["context"]) + 1))
    return lm, tokens[:, :-1], tokens[:, 1:], "cross_entropy"


class _Ways:
    """The ways of getting ``J v`` for two vectors on one model and batch."""

    def __init__(self, model: nn.Module, x: torch.Tensor) -> None:
        self.model, self.x = model, x
        self.names = [n for n, _ in model.named_parameters()]
        self.params: list[torch.Tensor] = [p for _, p in model.named_parameters()]
        self.primals = tuple(p.detach() for p in self.params)
        gen = torch.Generator().manual_seed(1)
        self.vectors = [[torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in self.params]
                        for _ in range(2)]
        self.state = RandomState.capture()
        self.cached = self._linearize()[1]

    def _f(self, *values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(self.model, dict(zip(self.names, values, strict=True)),
                                            (self.x,))
        return out

    def _linearize(self) -> tuple[torch.Tensor, Callable[..., torch.Tensor]]:
        # torch's constant folding warns about the get_attr nodes it inserts itself
        with torch.no_grad(), replayed(self.model, self.state), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")
            return linearize(self._f, *self.primals)  # type: ignore[no-any-return]

    def forward_no_grad(self) -> list[torch.Tensor]:
        with torch.no_grad(), replayed(self.model, self.state):
            return [self._f(*self.primals)]

    def two_dual_passes(self) -> list[torch.Tensor]:
        lin = ForwardLinearization(self.model, lambda: self.model(self.x),
                                   self.params, lambda: replayed(self.model, self.state))
        return lin.jacobian_vector_products(self.vectors)

    def func_linearize(self, split: dict[str, list[float]] | None = None) -> list[torch.Tensor]:
        start = time.perf_counter()
        _, linear = self._linearize()
        traced = time.perf_counter()
        with torch.no_grad():
            out = [linear(*v) for v in self.vectors]
        if split is not None:
            split["func_linearize_trace"].append(traced - start)
            split["func_linearize_apply"].append(time.perf_counter() - traced)
        return out

    def cached_linear_map(self) -> list[torch.Tensor]:
        self.forward_no_grad()
        with torch.no_grad():
            return [self.cached(*v) for v in self.vectors]

    def vmap_jvp(self) -> list[torch.Tensor]:
        stacked = tuple(torch.stack(parts) for parts in zip(*self.vectors, strict=True))
        with torch.no_grad(), replayed(self.model, self.state):
            both = vmap(lambda *t: jvp(self._f, self.primals, t)[1], randomness="same")(*stacked)
        return list(both)


def _kfac_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str
               ) -> Callable[[PhaseProfile], tuple[float, float]]:
    """A ``kaisa.KFAC`` step on the task; returns (step seconds, J v phase seconds)."""
    opt = kaisa.KFAC(model, loss=loss)

    def step(profile: PhaseProfile) -> tuple[float, float]:
        profile.reset()
        start = time.perf_counter()
        opt.step(lambda: (model(x), y))
        total = time.perf_counter() - start
        return total, profile.by_phase().get("jacobian_vector_products", 0.0)

    return step


def probes() -> dict[str, str]:
    """What forward-mode AD allows beyond one tangent per pass (the error, or 'supported')."""
    x, out = torch.randn(3), {}

    def nested() -> None:
        with fwad.dual_level(), fwad.dual_level():
            pass

    def dual_of_dual() -> None:
        with fwad.dual_level():
            fwad.make_dual(fwad.make_dual(x, torch.ones(3)), torch.ones(3))  # type: ignore[no-untyped-call]

    def complex_tangent() -> None:
        layer = nn.Linear(3, 2)
        with torch.no_grad(), fwad.dual_level():
            weight = fwad.make_dual(layer.weight.detach(),  # type: ignore[no-untyped-call]
                                    torch.ones(2, 3, dtype=torch.complex64))
            F.linear(x, weight)

    for key, probe in (("nested_dual_level", nested), ("dual_of_a_dual", dual_of_dual),
                       ("complex_tangent_through_linear", complex_tangent)):
        try:
            probe()
            out[key] = "supported"
        except RuntimeError as err:
            out[key] = str(err).splitlines()[0]
    return out


def float64_difference(name: str, smoke: bool) -> float:
    """Largest ``|J v|`` difference, ``func_linearize`` against today's path, over ``|J v|``."""
    model, x, _, _ = _task(name, smoke, torch.float64)
    ways = _Ways(model, x)
    today, other = ways.two_dual_passes(), ways.func_linearize()
    return max(float((a - b).abs().max() / a.abs().max())
               for a, b in zip(today, other, strict=True))


def measure(name: str, iters: int, smoke: bool) -> dict[str, Any]:
    """Interleaved medians (ms), the projected savings and the float64 check of one task."""
    model, x, y, loss = _task(name, smoke)
    ways = _Ways(model, x)
    kfac_model, _, _, _ = _task(name, smoke)
    kfac = _kfac_step(kfac_model, x, y, loss)
    times: dict[str, list[float]] = {k: [] for k in (
        "kfac_step", "kfac_jacobian_vector_products", "forward_no_grad", "two_dual_passes",
        "func_linearize", "func_linearize_trace", "func_linearize_apply", "cached_linear_map",
        "vmap_jvp")}
    timed: dict[str, Callable[[], object]] = {
        "forward_no_grad": ways.forward_no_grad, "two_dual_passes": ways.two_dual_passes,
        "func_linearize": lambda: ways.func_linearize(times), "cached_linear_map":
        ways.cached_linear_map, "vmap_jvp": ways.vmap_jvp}
    with PhaseProfile() as profile:
        for i in range(iters + 1):
            step, products = kfac(profile)
            times["kfac_step"].append(step)
            times["kfac_jacobian_vector_products"].append(products)
            keys = list(timed)[i % len(timed):] + list(timed)[: i % len(timed)]
            for key in keys:
                start = time.perf_counter()
                timed[key]()
                times[key].append(time.perf_counter() - start)
    med = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    return {
        "median_ms": {k: round(v, 2) for k, v in med.items()},
        "over_two_dual_passes": {k: round(med[k] / med["two_dual_passes"], 3) for k in timed},
        "projected_kfac_step_saving": {
            k: round((med["two_dual_passes"] - med[k]) / med["kfac_step"], 3)
            for k in ("func_linearize", "cached_linear_map", "vmap_jvp")},
        "ideal_saving_one_forward": round(med["forward_no_grad"] / med["kfac_step"], 3),
        "float64_func_linearize_vs_today_relative": float64_difference(name, smoke),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measures the tasks, prints and writes the JSON."""
    parser = harness.parser(__doc__, RESULTS / "jvp_linearize.json")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--tasks", default="autoencoder,gpt")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 timed iteration")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        iters = 1 if args.smoke else args.iters
        result: dict[str, Any] = {
            "smoke": args.smoke, "iters": iters,
            "load_average_at_start": list(os.getloadavg()), "probes": probes(),
            "tasks": {t: measure(t, iters, args.smoke) for t in args.tasks.split(",")},
        }
        result["load_average_at_end"] = list(os.getloadavg())
    finally:
        torch.set_num_threads(threads)
    result = harness.write(args.out, "jvp_linearize", result, argv,
                           script="bench/experiments/jvp_linearize.py", threads=1)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
