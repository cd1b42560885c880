"""Where a KFACMuon step's time goes, against Muon's, on the byte GPT (one process).

Every configuration is built from the same initial weights; each step times the forward +
backward pass and ``step()`` (with ``zero_grad``) on the host, the configurations taking
turns step by step so that the machine's load falls on all alike; the first
``--warmup`` steps are not counted. For KFACMuon the curvature core's host seconds by
phase (``factors``: the hooks' statistics and their fold; ``decompositions``: the refresh
of ``M`` or of the bases, averaged over the steps; ``preconditioning``: the per-block
rule, Newton-Schulz included) are reported per step.

Configurations: ``muon`` (``torch.optim.Muon`` on the blocks' matrices, AdamW on the
rest) and ``MODE[-rK][-fK][-dK][-oK]`` for ``kaisa.KFACMuon(curvature=MODE)`` with
``factor_rows=K``, factors every ``K`` steps, ``max_input_dim=K``, ``max_basis_dim=K``.

    python bench/step_cost/kfac_muon_step.py --wide       # d 256, 6 layers, context 128, batch 16
    python bench/step_cost/kfac_muon_step.py --configs muon,input --steps 4 --warmup 1 --tiny
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import kaisa
from bench import harness
from kaisa.train.models.gpt import gpt

CONFIGS = ("muon,identity,input,input-r256,input-r256-d256,input-r256-d256-f2,eigen-r256,"
           "eigen-r256-f2,eigen-r256-o256")


class _MuonAdamW:
    """``torch.optim.Muon`` on the matrices and AdamW on the rest, stepped as one."""

    def __init__(self, matrices: list[nn.Parameter], rest: list[nn.Parameter]) -> None:
        self.parts = (torch.optim.Muon(matrices, lr=0.05, weight_decay=0.1),
                      torch.optim.AdamW(rest, lr=3e-3))

    def step(self) -> None:
        for o in self.parts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.parts:
            o.zero_grad()


def _option(options: list[str], letter: str) -> int | None:
    return next((int(o[1:]) for o in options if re.fullmatch(letter + r"\d+", o)), None)


def build(name: str, sizes: dict[str, int]) -> tuple[nn.Module, Any]:
    """The model (seed 0) and the optimizer of configuration ``name``."""
    torch.manual_seed(0)
    model = gpt(**sizes)
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for p in named.values() if all(p is not q for q in matrices)]
    if name == "muon":
        return model, _MuonAdamW(matrices, rest)
    mode, *options = name.split("-")
    every = _option(options, "f") or 1
    return model, kaisa.KFACMuon(
        model, lr=0.05, weight_decay=0.1, curvature=mode,
        param_groups=[{"params": matrices}, {"params": rest, "lr": 3e-3}],
        factor_rows=_option(options, "r"), factor_update_steps=every,
        factor_decay=0.95**every, max_input_dim=_option(options, "d"),
        max_basis_dim=_option(options, "o"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Times every configuration; writes the JSON; returns its payload."""
    p = harness.parser(__doc__, harness.RESULTS / "kfac_muon_step.json")
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--wide", action="store_true")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = dict(d_model=128, context=64, n_layers=4, n_heads=4)
    batch = 32
    if args.wide:
        sizes, batch = dict(d_model=256, context=128, n_layers=6, n_heads=8), 16
    if args.tiny:
        sizes, batch = dict(d_model=16, context=8, n_layers=2, n_heads=2), 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, sizes["context"] + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
    names = args.configs.split(",")
    runs = {n: build(n, sizes) for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {"fwd_bwd": [], "step": []} for n in names}
    for i in range(args.warmup + args.steps):
        for n in names[i % len(names):] + names[:i % len(names)]:
            model, opt = runs[n]
            t0 = time.perf_counter()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            if i >= args.warmup:
                times[n]["fwd_bwd"].append(t1 - t0)
                times[n]["step"].append(t2 - t1)
    rows: dict[str, Any] = {}
    base = None
    for n in names:
        fb = statistics.median(times[n]["fwd_bwd"]) * 1e3
        st = statistics.median(times[n]["step"]) * 1e3
        total = statistics.median([a + b for a, b in zip(times[n]["fwd_bwd"],
                                                          times[n]["step"], strict=True)]) * 1e3
        base = base or total
        _, opt = runs[n]
        phases = ({k: v * 1e3 / (args.warmup + args.steps)
                   for k, v in opt.curvature.timings.items()}
                  if isinstance(opt, kaisa.KFACMuon) else {})
        rows[n] = {"fwd_bwd_ms": fb, "step_ms": st, "total_ms": total,
                   "total_vs_first": total / base, "phases_ms_per_step": phases}
        print(f"{n:22s} fwd+bwd {fb:8.1f}  step {st:7.1f}  total {total:8.1f} ms "
              f"({total / base:.2f}x)  {({k: round(v, 1) for k, v in phases.items()})}",
              flush=True)
    payload = {"sizes": sizes, "batch": batch, "steps": args.steps, "warmup": args.warmup,
               "results": rows}
    harness.write(args.out, "kfac_muon_step", payload, argv=argv,
                  script="bench/step_cost/kfac_muon_step.py")
    return payload


if __name__ == "__main__":
    main()
