"""Optimisers on a byte-level GPT over the Python standard library's source.

One run, one seed: every optimiser starts from the same initial weights and sees the
same batches (random windows of ``context + 1`` bytes of the first 90% of the corpus,
a function of (seed, step)); validation loss (cross-entropy per byte) on a fixed set of
windows of the last 10% every ``--eval-every`` steps, against step and against
training seconds (evaluation excluded). Single-threaded.

Configurations (``--only`` picks some; the default runs the first nine):

* ``adamw@lr`` for lr 3e-4, 1e-3, 3e-3 (the best is reported as "AdamW"; 1e-2 is worse).
* ``muon``: ``torch.optim.Muon`` (lr 0.05) on the 2-D matrices inside the blocks
  (attention in/out projections, feed-forward), AdamW (3e-3) for the rest (tied
  embedding/head, positions, norms, biases).
* ``soap``: ``bench/soap.py`` (lr 1e-2, betas (0.95, 0.95), basis every 10 steps).
* ``kfac``: ``kaisa.KFAC(model, loss="cross_entropy")`` with its defaults, and
  ``kfac@damping=0.1`` (kaisa-train's ``--task lm`` default: damping 0.1, inverses
  every 5, ``pi_inverse``). Adaptive lr and momentum: no schedule, no clipping.
* ``ekfac[-OPTION...]@lr``: ``kaisa.EKFAC`` (eigenbases by ``eigh`` every 10 steps), with
  AdamW's betas and eps and factors every step unless an option says otherwise: ``fK``
  factors every K steps with ``factor_decay`` 0.95**K (the running average's horizon kept
  in steps), ``bNN`` beta2 0.NN, ``qr`` bases refreshed by a warm-started QR step
  (``eigh`` every 10th refresh). The default run has ``ekfac@3e-3`` (AdamW's recipe
  unchanged), ``ekfac-b95@1e-2``, ``ekfac-f5-b95@1e-2`` and ``ekfac-f5-b95@3e-3``.
* ``adamw+kfac``: ``kaisa.KFACPreconditioner`` (damping 0.03, factors every step,
  inverses every 10) + AdamW 3e-3.

Every configuration trains in lockstep with the others (step ``i`` of each before step
``i + 1`` of any, the order rotated every step), so changes in the machine's load fall on
all alike; the per-step cost is the ratio of median step times.

The lr-based ones use warmup 20 steps then cosine to 10%, gradient clipping at norm
1.0 (before preconditioning) and weight decay 0.1 on matrices (AdamW, Muon, SOAP, EKFAC).

    python bench/gpt.py                       # 300 steps, context 64, batch 32, d 128
    python bench/gpt.py --tiny --steps 3 --out /tmp/gpt.json   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.models.gpt import gpt
from kaisa.train.text import load_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soap import SOAP

RESULTS = Path(__file__).resolve().parent / "results"
ADAMW_GRID = (3e-4, 1e-3, 3e-3)
CONFIGS = (
    *(f"adamw@{lr:g}" for lr in ADAMW_GRID), "muon", "soap", "kfac", "ekfac@0.003",
    "ekfac-b95@0.01", "ekfac-f5-b95@0.01", "ekfac-f5-b95@0.003",
)
EXTRA_CONFIGS = ("adamw+kfac", "kfac@damping=0.1", "ekfac-qr@0.003")


def lr_factor(step: int, total: int, warmup: int = 20) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(params: list[tuple[str, nn.Parameter]], lr: float) -> list[dict[str, Any]]:
    """Weight decay 0.1 on matrices (2-D), none on the rest."""
    matrices = [p for _, p in params if p.ndim == 2]
    others = [p for _, p in params if p.ndim != 2]
    return [
        {"params": matrices, "weight_decay": 0.1, "lr": lr},
        {"params": others, "weight_decay": 0.0, "lr": lr},
    ]


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Named parameters, a tied one once (``named_parameters`` de-duplicates)."""
    return list(model.named_parameters())


class Run:
    """One configuration: ``step(x, y)`` trains one step; ``timings()`` its K-FAC split."""

    def __init__(self, name: str, model: nn.Module, steps: int) -> None:
        self.name, self.model = name, model
        self.optimizers: list[torch.optim.Optimizer] = []
        self.pre: Any = None
        self.kfac: Any = None
        self.ekfac: Any = None
        self.clip = True
        params = unique_params(model)
        if name.startswith("adamw@"):
            self.optimizers = [torch.optim.AdamW(decay_groups(params, float(name[6:])))]
        elif name == "muon":
            hidden = [(n, p) for n, p in params if p.ndim == 2 and n.startswith("blocks.")]
            ids = {id(p) for _, p in hidden}
            rest = [(n, p) for n, p in params if id(p) not in ids]
            self.optimizers = [
                torch.optim.Muon([p for _, p in hidden], lr=0.05, weight_decay=0.1),
                torch.optim.AdamW(decay_groups(rest, 3e-3)),
            ]
        elif name == "soap":
            groups = decay_groups(params, 1e-2)
            self.optimizers = [SOAP(groups, lr=1e-2, betas=(0.95, 0.95))]
        elif name == "adamw+kfac":
            adamw = torch.optim.AdamW(decay_groups(params, 3e-3))
            self.optimizers = [adamw]
            # every Kronecker kind: Linear, the attention projections, the tied
            # embedding/head block (KFACPreconditioner's default is kfac-pytorch's two)
            self.pre = kaisa.KFACPreconditioner(
                model, damping=0.03, factor_update_steps=1, inv_update_steps=10,
                lr=lambda _step: float(adamw.param_groups[0]["lr"]),
                layer_kinds=("linear", "attention", "embedding"),
            )
        elif name.startswith("ekfac"):
            kind, _, lr_text = name.partition("@")
            lr, options = float(lr_text), kind.split("-")[1:]
            every = next((int(o[1:]) for o in options if re.fullmatch(r"f\d+", o)), 1)
            beta2 = next((int(o[1:]) / 100 for o in options if re.fullmatch(r"b\d\d", o)), 0.999)
            # factors every `every` steps, the running average's horizon kept in steps
            self.ekfac = kaisa.EKFAC(
                model, lr=lr, betas=(0.9, beta2), param_groups=decay_groups(params, lr),
                factor_update_steps=every, factor_decay=0.95**every, basis_update_steps=10,
                basis_refresh="qr" if "qr" in options else "eigh",
            )
            self.optimizers = [self.ekfac]
        elif name.startswith("kfac"):
            extra: dict[str, Any] = {}
            if name == "kfac@damping=0.1":
                extra = dict(damping=0.1, inv_update_steps=5, compute_method="pi_inverse")
            self.kfac = kaisa.KFAC(model, loss="cross_entropy", **extra)
            self.clip = False
        else:
            raise ValueError(f"unknown configuration {name!r}; see the module docstring")
        self.base = [[g["lr"] for g in o.param_groups] for o in self.optimizers]
        self.steps = steps

    def step(self, index: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step (``index`` from 0); returns the minibatch loss."""
        if self.kfac is not None:
            return float(self.kfac.step(lambda: (self.model(x), y)))
        factor = lr_factor(index, self.steps)
        for optimizer, base in zip(self.optimizers, self.base, strict=True):
            for group, lr in zip(optimizer.param_groups, base, strict=True):
                group["lr"] = lr * factor
        out = self.model(x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.pre is not None:
            self.pre.step()
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def timings(self) -> dict[str, float]:
        """Cumulative seconds per K-FAC phase (empty for first-order optimisers)."""
        if self.kfac is not None:
            phases = dict(self.kfac.timings)
            phases |= {f"curvature.{k}": v for k, v in self.kfac.curvature.timings.items()}
            return {k: float(v) for k, v in phases.items()}
        if self.pre is not None:
            return {k: float(v) for k, v in self.pre.timings.items()}
        if self.ekfac is not None:
            return {k: float(v) for k, v in self.ekfac.curvature.timings.items()}
        return {}


@torch.no_grad()
def validate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean cross-entropy per byte over the validation windows."""
    model.eval()
    total = 0.0
    for start in range(0, len(x), 64):
        out = model(x[start : start + 64])
        total += float(F.cross_entropy(out.flatten(0, 1), y[start : start + 64].flatten(),
                                       reduction="sum"))
    model.train()
    return total / y.numel()


class Trainee:
    """One configuration's model, optimiser(s), curve and per-step times."""

    def __init__(self, name: str, args: argparse.Namespace, data: Any,
                 init: dict[str, Any]) -> None:
        self.name, self.data = name, data
        self.model = gpt(d_model=args.d_model, context=args.context, n_layers=args.layers,
                         n_heads=args.heads)
        self.model.load_state_dict(init)
        self.run = Run(name, self.model, args.steps)
        self.curve = [{"step": 0, "seconds": 0.0,
                       "val_loss": validate(self.model, data.test_x, data.test_y)}]
        self.seconds = 0.0
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self.done = False

    def step(self, index: int, x: torch.Tensor, y: torch.Tensor, evaluate: bool) -> None:
        """Train step ``index`` (timed), then validate if ``evaluate`` (not timed)."""
        start = time.perf_counter()
        loss = self.run.step(index, x, y)
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        self.step_seconds.append(elapsed)
        self.losses.append(loss)
        if not math.isfinite(loss):
            self.curve.append({"step": index + 1, "seconds": self.seconds, "val_loss": math.nan})
            self.done = True
            return
        if evaluate:
            val = validate(self.model, self.data.test_x, self.data.test_y)
            self.curve.append({"step": index + 1, "seconds": self.seconds, "val_loss": val})
            print(f"[{self.name}] step {index + 1:4d}  {self.seconds:7.1f}s  train {loss:.3f}  "
                  f"val {val:.3f}", flush=True)

    def result(self) -> dict[str, Any]:
        """The JSON record; removes the hooks."""
        steps = self.curve[-1]["step"]
        run, model = self.run, self.model
        result: dict[str, Any] = {
            "config": self.name,
            "curve": self.curve,
            "final_val_loss": self.curve[-1]["val_loss"],
            "train_seconds": self.seconds,
            "ms_per_step": 1e3 * self.seconds / max(1, steps),
            "median_ms_per_step": 1e3 * statistics.median(self.step_seconds or [math.nan]),
            "final_train_loss": self.losses[-1] if self.losses else math.nan,
        }
        phases = run.timings()
        if phases:
            result["ms_per_step_by_phase"] = {k: 1e3 * v / max(1, steps) for k, v in phases.items()}
        for owner in (run.kfac, run.pre, run.ekfac):
            if owner is not None:
                result["coverage"] = _coverage(owner, model)
                (owner if owner is run.pre else owner.curvature).remove_hooks()
        return result


def train_all(
    names: list[str], args: argparse.Namespace, data: Any, init: dict[str, Any]
) -> list[dict[str, Any]]:
    """Train every configuration in lockstep from ``init``; their curves, times and costs.

    Step ``i`` of every configuration runs before step ``i + 1`` of any, in an order rotated
    each step, so a change in the machine's load over the run falls on all of them alike
    and the ratios of their median step times are comparable (the machine may be shared).
    """
    trainees = [Trainee(name, args, data, init) for name in names]
    every = torch.arange(args.batch)
    for index in range(args.steps):
        x, y = data.batch(every, index)
        evaluate = (index + 1) % args.eval_every == 0 or index + 1 == args.steps
        shift = index % len(trainees)
        for trainee in trainees[shift:] + trainees[:shift]:
            if not trainee.done:
                trainee.step(index, x, y, evaluate)
    return [trainee.result() for trainee in trainees]


def _coverage(optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """Share of parameter elements in K-FAC blocks (``coverage()``)."""
    table = optimizer.coverage()
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    covered = sum(sizes.get(name, 0) for name, kind in table.items() if kind != "first-order")
    return {
        "registered_share_of_elements": covered / sum(sizes.values()),
        "first_order": sorted(
            {re.sub(r"\.\d+\.", ".*.", n) for n, k in table.items() if k == "first-order"}
        ),
    }


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Best AdamW, per-step time ratios to it, steps/seconds to its final loss."""
    adamw = [r for r in results if r["config"].startswith("adamw@")]
    finite = [r for r in adamw if math.isfinite(r["final_val_loss"])]
    if not finite:
        return {}
    best = min(finite, key=lambda r: r["final_val_loss"])
    target = best["final_val_loss"]
    for result in results:
        result["time_ratio_to_adamw"] = (result["median_ms_per_step"]
                                         / best["median_ms_per_step"])
        hit = next((p for p in result["curve"] if p["val_loss"] <= target), None)
        result["step_to_adamw_final"] = None if hit is None else hit["step"]
        result["seconds_to_adamw_final"] = None if hit is None else hit["seconds"]
    return {"best_adamw": best["config"], "adamw_final_val_loss": target}


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """Two panels: validation loss against step and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for result in results:
        curve = [p for p in result["curve"] if math.isfinite(p["val_loss"])]
        style = ":" if result["config"].startswith("adamw@") else "-"
        for axis, key in zip(axes, ("step", "seconds"), strict=True):
            axis.plot([p[key] for p in curve], [p["val_loss"] for p in curve], style,
                      label=result["config"])
    for axis, label in zip(axes, ("step", "training seconds (1 thread)"), strict=True):
        axis.set_xlabel(label)
        axis.set_ylabel("validation loss (nats per byte)")
        axis.grid(alpha=0.3)
    start = results[0]["curve"][0]["val_loss"]
    for axis in axes:
        axis.set_ylim(1.0, min(start, 4.0))
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; write JSON (and the plot); return the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--text-bytes", type=int, default=2 * 2**20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(CONFIGS),
                        help="comma-separated configs (also: " + ",".join(EXTRA_CONFIGS) + ")")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke size: d 32, 2 layers, context 16, batch 4, 8 eval windows")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpt.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.context, args.batch = 32, 2, 16, 4
        args.eval_windows, args.eval_every = 8, max(1, args.steps // 2)
    torch.set_num_threads(1)
    data = load_text(context=args.context, examples_per_epoch=args.batch,
                     max_bytes=args.text_bytes, eval_windows=args.eval_windows, seed=args.seed)
    torch.manual_seed(args.seed)
    init = gpt(d_model=args.d_model, context=args.context, n_layers=args.layers,
               n_heads=args.heads).state_dict()
    started = time.perf_counter()
    results = train_all([n for n in args.only.split(",") if n], args, data, init)
    summary = summarise(results)
    payload = {
        "benchmark": "bench/gpt.py",
        "settings": vars(args) | {"out": str(args.out)},
        "corpus_bytes": {"train": len(data.train_stream), "validation_windows": len(data.test_x)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": 1},
        "wall_seconds": time.perf_counter() - started,
        "summary": summary,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if not args.no_plot:
        title = (f"byte GPT d{args.d_model} x{args.layers}, context {args.context}, batch "
                 f"{args.batch}, {args.steps} steps, stdlib text (1 thread)")
        plot(results, args.out.with_suffix(".png"), title)
    _print_table(results, summary)
    return payload


def _print_table(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    target = summary.get("adamw_final_val_loss", math.nan)
    print(f"\n| config | final val loss | median ms/step | x AdamW | steps (s) to {target:.3f} |")
    print("|---|---|---|---|---|")
    for r in results:
        hit = "-" if r.get("step_to_adamw_final") is None else (
            f"{r['step_to_adamw_final']} ({r['seconds_to_adamw_final']:.1f})")
        print(f"| {r['config']} | {r['final_val_loss']:.3f} | {r['median_ms_per_step']:.1f} "
              f"| {r.get('time_ratio_to_adamw', math.nan):.2f} | {hit} |")


if __name__ == "__main__":
    main()
