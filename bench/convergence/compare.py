"""The optimiser comparisons' shared machinery (``gpt.py``, ``cnn.py`` beside it).

A task (:class:`Task`: a model factory, batches as a function of the step, a validation
function and a :class:`Recipe` of its task-specific settings) is trained once per
configuration from the same initial weights on the same batches; validation every
``eval_every`` steps against step and training seconds (evaluation excluded). Every
configuration trains in lockstep with the others (step ``i`` of each before step ``i + 1``
of any, the order rotated every step), so changes in the machine's load fall on all alike;
the per-step cost is the ratio of median step times.

Configurations (``@value`` overrides a learning rate where one is named):

* ``adamw@lr``: AdamW.
* ``muon`` / ``muon@lr``: ``torch.optim.Muon`` on the recipe's matrices (more than 2-D
  ones through 2-D views ``(shape[0], -1)`` sharing their storage, as Keller Jordan's
  recipe flattens convolution filters), AdamW for the rest.
* ``soap`` / ``soap@lr``: ``bench/convergence/soap.py``.
* ``adamw+kfac`` / ``adamw+kfac@lr``: ``kaisa.KFACPreconditioner`` (factors every step,
  inverses every 10) + AdamW.
* ``kfac-muon-MODE[-rK][@lr]``: ``kaisa.KFACMuon`` with ``curvature=MODE`` (``input``,
  ``eigen``, ``identity``) on the recipe's Muon matrices (lr as ``muon``'s, weight decay
  0.1, refresh every 10 steps, factor decay 0.95, ``rK``: factors from ``K`` random rows of
  each call, ``fK``: factors every ``K`` steps with decay 0.95**K, ``dK``: ``input``'s
  ``max_input_dim``, ``oK``: ``eigen``'s ``max_basis_dim``, ``gX``: ``input``'s ridge
  ``X``), AdamW as ``muon``'s for the rest.
* ``ekfac[-OPTION...]@lr``: ``kaisa.EKFAC`` (eigenbases by ``eigh`` every 10 steps), with
  AdamW's betas and eps and factors every step unless an option says otherwise: ``fK``
  factors every K steps with ``factor_decay`` 0.95**K (the running average's horizon kept
  in steps), ``bNN`` beta2 0.NN, ``qr`` bases refreshed by a warm-started QR step
  (``eigh`` every 10th refresh), ``rK`` factor statistics from ``K`` random rows of each
  call (``factor_rows``), ``oK`` one-sided bases above dimension ``K`` (``max_basis_dim``),
  ``graft`` / ``rms`` each covered parameter's update
  rescaled to Adam's update norm, every step / by a smoothed ratio
  (``bench/convergence/ekfac_transfer.py``).
* ``klshampoo`` / ``klshampoo@lr``: ``bench/convergence/kl_shampoo.py`` (betas (0.9, 0.95), bases
  every 10 steps).
* ``kfac``: ``kaisa.KFAC(model, loss="cross_entropy")`` with its defaults;
  ``kfac@damping=0.1``: damping 0.1, inverses every 5, ``pi_inverse``. Adaptive lr and
  momentum: no schedule, no clipping.

The lr-based ones use warmup 20 steps then cosine to 10%, gradient clipping at norm 1.0
(before preconditioning) and weight decay 0.1 on the recipe's decayed parameters.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ekfac_transfer import ScaledEKFAC
from kl_shampoo import KLShampoo
from soap import SOAP
from torch import nn

import kaisa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness

Named = list[tuple[str, nn.Parameter]]
Predicate = Callable[[str, nn.Parameter], bool]


def _matrix(_name: str, p: nn.Parameter) -> bool:
    return p.ndim == 2


@dataclass(frozen=True)
class Recipe:
    """A task's settings of the shared configurations.

    Attributes:
        muon_params: Which parameters Muon takes (the rest: AdamW at ``muon_adamw_lr``).
        decayed: Which parameters get weight decay 0.1 (default: the 2-D ones).
        muon_lr: Muon's lr (``muon``).
        muon_adamw_lr: The AdamW lr of the parameters Muon does not take.
        soap_lr: SOAP's lr (``soap``).
        klshampoo_lr: KL-Shampoo's lr (``klshampoo``).
        soap_flatten: SOAP and KL-Shampoo precondition parameters of more than 2 dims as matrices
            ``(shape[0], -1)`` (else plain Adam on them).
        kfac_adamw_lr: The AdamW lr under ``adamw+kfac``.
        kfac_damping: ``adamw+kfac``'s damping.
        kfac_layer_kinds: ``adamw+kfac``'s registered block kinds.
        loss: The training loss of the model's output and the targets.
    """

    muon_params: Predicate
    decayed: Predicate = _matrix
    muon_lr: float = 0.05
    muon_adamw_lr: float = 3e-3
    soap_lr: float = 1e-2
    soap_flatten: bool = False
    klshampoo_lr: float = 1e-2
    kfac_adamw_lr: float = 3e-3
    kfac_damping: float = 0.03
    kfac_layer_kinds: tuple[str, ...] = ("linear", "conv2d")
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy


@dataclass(frozen=True)
class Task:
    """What :func:`train` needs of a benchmark.

    Attributes:
        make_model: A fresh model (its weights are replaced by the shared initial ones).
        batch: Inputs and targets of training step ``index`` (from 0).
        validate: Validation metrics of the model; ``'val_loss'`` first.
        recipe: The task's settings of the configurations.
        steps: Training steps.
        eval_every: Steps between validations (and after the last).
    """

    make_model: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    validate: Callable[[nn.Module], dict[str, float]]
    recipe: Recipe
    steps: int
    eval_every: int


def lr_factor(step: int, total: int, warmup: int = 20) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from 1 to 0.1 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_groups(params: Named, lr: float, decayed: Predicate = _matrix) -> list[dict[str, Any]]:
    """Weight decay 0.1 on the ``decayed`` parameters (default: matrices), none on the rest."""
    chosen = [p for n, p in params if decayed(n, p)]
    others = [p for n, p in params if not decayed(n, p)]
    return [
        {"params": chosen, "weight_decay": 0.1, "lr": lr},
        {"params": others, "weight_decay": 0.0, "lr": lr},
    ]


def _value(name: str, default: float) -> float:
    """The number after ``@`` in ``name``, else ``default``."""
    return float(name.partition("@")[2]) if "@" in name else default


class Run:
    """One configuration: ``step(x, y)`` trains one step; ``timings()`` its K-FAC split."""

    def __init__(self, name: str, model: nn.Module, steps: int, recipe: Recipe) -> None:
        self.name, self.model, self.loss = name, model, recipe.loss
        self.optimizers: list[torch.optim.Optimizer] = []
        self.views: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.pre: Any = None
        self.kfac: Any = None
        self.ekfac: Any = None
        params = list(model.named_parameters())  # a tied parameter once
        if name.startswith("adamw@"):
            self.optimizers = [torch.optim.AdamW(decay_groups(params, float(name[6:]),
                                                              recipe.decayed))]
        elif name == "muon" or name.startswith("muon@"):
            chosen = [p for n, p in params if recipe.muon_params(n, p)]
            ids = {id(p) for p in chosen}
            rest = [(n, p) for n, p in params if id(p) not in ids]
            self.views = [(p, p.detach().view(p.shape[0], -1)) for p in chosen if p.ndim > 2]
            flat = {id(p): v for p, v in self.views}
            self.optimizers = [
                torch.optim.Muon([flat.get(id(p), p) for p in chosen],
                                 lr=_value(name, recipe.muon_lr), weight_decay=0.1),
                torch.optim.AdamW(decay_groups(rest, recipe.muon_adamw_lr, recipe.decayed)),
            ]
        elif name.startswith("kfac-muon-"):
            kind, _, lr_text = name.partition("@")
            mode, *options = kind.split("-")[2:]
            rows = next((int(o[1:]) for o in options if re.fullmatch(r"r\d+", o)), None)
            every = next((int(o[1:]) for o in options if re.fullmatch(r"f\d+", o)), 1)
            widest = next((int(o[1:]) for o in options if re.fullmatch(r"d\d+", o)), None)
            dense = next((int(o[1:]) for o in options if re.fullmatch(r"o\d+", o)), None)
            ridge = next((float(o[1:]) for o in options if re.fullmatch(r"g[\d.]+", o)), 0.2)
            chosen = [p for n, p in params if recipe.muon_params(n, p)]
            ids = {id(p) for p in chosen}
            rest = [(n, p) for n, p in params if id(p) not in ids]
            self.ekfac = kaisa.KFACMuon(
                model, lr=_value(name, recipe.muon_lr), weight_decay=0.1, curvature=mode,
                param_groups=[{"params": chosen},
                              *decay_groups(rest, recipe.muon_adamw_lr, recipe.decayed)],
                refresh_steps=10, factor_update_steps=every, factor_decay=0.95**every,
                factor_rows=rows, max_input_dim=widest, max_basis_dim=dense, ridge=ridge,
            )
            self.optimizers = [self.ekfac]
        elif name == "soap" or name.startswith("soap@"):
            lr = _value(name, recipe.soap_lr)
            self.optimizers = [SOAP(decay_groups(params, lr, recipe.decayed), lr=lr,
                                    betas=(0.95, 0.95), flatten=recipe.soap_flatten)]
        elif name == "klshampoo" or name.startswith("klshampoo@"):
            lr = _value(name, recipe.klshampoo_lr)
            self.optimizers = [KLShampoo(decay_groups(params, lr, recipe.decayed), lr=lr,
                                         flatten=recipe.soap_flatten)]
        elif name == "adamw+kfac" or name.startswith("adamw+kfac@"):
            lr = _value(name, recipe.kfac_adamw_lr)
            adamw = torch.optim.AdamW(decay_groups(params, lr, recipe.decayed))
            self.optimizers = [adamw]
            self.pre = kaisa.KFACPreconditioner(
                model, damping=recipe.kfac_damping, factor_update_steps=1, inv_update_steps=10,
                lr=lambda _step: float(adamw.param_groups[0]["lr"]),
                layer_kinds=recipe.kfac_layer_kinds,
            )
        elif name.startswith("ekfac"):
            kind, _, lr_text = name.partition("@")
            lr, options = float(lr_text), kind.split("-")[1:]
            every = next((int(o[1:]) for o in options if re.fullmatch(r"f\d+", o)), 1)
            beta2 = next((int(o[1:]) / 100 for o in options if re.fullmatch(r"b\d\d", o)), 0.999)
            rows = next((int(o[1:]) for o in options if re.fullmatch(r"r\d+", o)), None)
            dense = next((int(o[1:]) for o in options if re.fullmatch(r"o\d+", o)), None)
            # factors every `every` steps, the running average's horizon kept in steps
            rule = next((o for o in options if o in ("graft", "rms")), None)
            make: Any = kaisa.EKFAC if rule is None else partial(ScaledEKFAC, rule=rule)
            self.ekfac = make(
                model, lr=lr, betas=(0.9, beta2),
                param_groups=decay_groups(params, lr, recipe.decayed),
                factor_update_steps=every, factor_decay=0.95**every, basis_update_steps=10,
                basis_refresh="qr" if "qr" in options else "eigh",
                kfac_approx="reduce" if "reduce" in options else "expand", factor_rows=rows,
                max_basis_dim=dense,
            )
            self.optimizers = [self.ekfac]
        elif name in ("kfac", "kfac@damping=0.1", "kfac-reduce"):
            extra: dict[str, Any] = {"kfac_approx": "reduce"} if name == "kfac-reduce" else {}
            if name == "kfac@damping=0.1":
                extra = dict(damping=0.1, inv_update_steps=5, compute_method="pi_inverse")
            self.kfac = kaisa.KFAC(model, loss="cross_entropy", **extra)
        else:
            raise ValueError(f"unknown configuration {name!r}")
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
        loss = self.loss(self.model(x), y)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        if self.pre is not None:
            self.pre.step()
        for p, view in self.views:
            assert p.grad is not None
            view.grad = p.grad.view(view.shape)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
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

    def close(self) -> dict[str, Any]:
        """Removes the hooks; the K-FAC optimisers' coverage (``{}`` for the others)."""
        owner = self.kfac or self.pre or self.ekfac
        if owner is None:
            return {}
        coverage = _coverage(owner, self.model)
        (owner if self.pre is not None else owner.curvature).remove_hooks()
        extra = {"coverage": coverage}
        if isinstance(owner, ScaledEKFAC):
            extra["mean_adam_over_ekfac_update_norm"] = owner.mean_ratio()
        return extra


class Trainee:
    """One configuration's model, optimiser(s), curve and per-step times."""

    def __init__(self, name: str, task: Task, init: dict[str, Any]) -> None:
        self.name, self.task = name, task
        self.model = task.make_model()
        self.model.load_state_dict(init)
        self.run = Run(name, self.model, task.steps, task.recipe)
        self.curve: list[dict[str, Any]] = [{"step": 0, "seconds": 0.0,
                                             **task.validate(self.model)}]
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
            self.curve.append({"step": index + 1, "seconds": self.seconds} | {
                k: math.nan for k in self.curve[0] if k not in ("step", "seconds")})
            self.done = True
            return
        if evaluate:
            metrics = self.task.validate(self.model)
            self.curve.append({"step": index + 1, "seconds": self.seconds, **metrics})
            shown = "".join(f"  {_SHORT.get(k, k)} {v:.3f}" for k, v in metrics.items())
            print(f"[{self.name}] step {index + 1:4d}  {self.seconds:7.1f}s  train {loss:.3f}"
                  f"{shown}", flush=True)

    def result(self) -> dict[str, Any]:
        """The JSON record; removes the hooks."""
        steps = self.curve[-1]["step"]
        result: dict[str, Any] = {"config": self.name, "curve": self.curve}
        result |= {f"final_{k}": v for k, v in self.curve[-1].items()
                   if k not in ("step", "seconds")}
        result |= {
            "train_seconds": self.seconds,
            "ms_per_step": 1e3 * self.seconds / max(1, steps),
            "median_ms_per_step": 1e3 * statistics.median(self.step_seconds or [math.nan]),
            "final_train_loss": self.losses[-1] if self.losses else math.nan,
        }
        phases = self.run.timings()
        if phases:
            result["ms_per_step_by_phase"] = {k: 1e3 * v / max(1, steps) for k, v in phases.items()}
        return result | self.run.close()


def train_all(task: Task, names: list[str], init: dict[str, Any]) -> list[dict[str, Any]]:
    """Train every configuration in lockstep from ``init``; their curves, times and costs.

    Step ``i`` of every configuration runs before step ``i + 1`` of any, in an order rotated
    each step, so a change in the machine's load over the run falls on all of them alike
    and the ratios of their median step times are comparable (the machine may be shared).
    """
    trainees = [Trainee(name, task, init) for name in names]
    for index in range(task.steps):
        x, y = task.batch(index)
        evaluate = (index + 1) % task.eval_every == 0 or index + 1 == task.steps
        shift = index % len(trainees)
        for trainee in trainees[shift:] + trainees[:shift]:
            if not trainee.done:
                trainee.step(index, x, y, evaluate)
    return [trainee.result() for trainee in trainees]


_SHORT = {"val_loss": "val", "val_accuracy": "acc"}


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
        # periodic work (factors, bases) is in the mean, not the median
        result["mean_time_ratio_to_adamw"] = result["ms_per_step"] / best["ms_per_step"]
        hit = next((p for p in result["curve"] if p["val_loss"] <= target), None)
        result["step_to_adamw_final"] = None if hit is None else hit["step"]
        result["seconds_to_adamw_final"] = None if hit is None else hit["seconds"]
        result["time_share_to_adamw_final"] = (
            None if hit is None else hit["seconds"] / best["train_seconds"])
    return {"best_adamw": best["config"], "adamw_final_val_loss": target}


def plot(
    results: list[dict[str, Any]], path: Path, title: str, *, ylabel: str,
    ylim: tuple[float, float] | None = None, log: bool = False,
) -> None:
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
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        if log:
            axis.set_yscale("log")
        if ylim is not None:
            axis.set_ylim(*ylim)
    axes[0].legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The Markdown table: final loss (and accuracy), cost ratio, steps to AdamW's loss."""
    target = summary.get("adamw_final_val_loss", math.nan)
    accuracy = any("final_val_accuracy" in r for r in results)
    head, rule = ("| final val acc ", "|---") if accuracy else ("", "")
    print(f"\n| config | final val loss {head}| median ms/step | x AdamW (median, mean) "
          f"| steps to {target:.3f} | seconds (share of AdamW's) |")
    print(f"|---|---{rule}|---|---|---|---|")
    for r in results:
        step, seconds = r.get("step_to_adamw_final"), r.get("seconds_to_adamw_final")
        share = r.get("time_share_to_adamw_final")
        hit = "- | -" if step is None else f"{step} | {seconds:.1f} ({share:.0%})"
        acc = f"| {r.get('final_val_accuracy', math.nan):.3f} " if accuracy else ""
        print(f"| {r['config']} | {r['final_val_loss']:.3f} {acc}| {r['median_ms_per_step']:.1f} "
              f"| {r.get('time_ratio_to_adamw', math.nan):.2f}, "
              f"{r.get('mean_time_ratio_to_adamw', math.nan):.2f} | {hit} |")


def compare(
    task: Task, names: list[str], init: dict[str, Any], head: dict[str, Any], out: Path, *,
    title: str | None, ylabel: str, ylim: Callable[[float], tuple[float, float]] | None = None,
    log: bool = False,
) -> dict[str, Any]:
    """Train every configuration; write the JSON (``bench.harness``'s envelope, ``head``, wall
    seconds, summary and results) and, with a ``title``, the plot beside it; print the table.

    Args:
        task: The benchmark.
        names: The configurations, in order.
        init: The shared initial weights.
        head: The JSON's first entries: ``benchmark`` (the script's path from the root),
            ``argv`` (its arguments; ``None``: ``sys.argv[1:]``), settings, data.
        out: The JSON's path (the plot: the same with ``.png``).
        title: The plot's title; ``None``: no plot.
        ylabel: The plot's y label.
        ylim: The plot's y range as a function of the first validation loss.
        log: A logarithmic y axis.

    Returns:
        The JSON object.
    """
    started = time.perf_counter()
    results = train_all(task, names, init)
    summary = summarise(results)
    head = dict(head)
    script, argv = head.pop("benchmark"), head.pop("argv", None)
    payload = harness.write(out, Path(script).stem, head | {
        "wall_seconds": time.perf_counter() - started,
        "summary": summary,
        "results": results,
    }, argv, script=script)
    if title is not None:
        start = results[0]["curve"][0]["val_loss"]
        plot(results, out.with_suffix(".png"), title, ylabel=ylabel,
             ylim=None if ylim is None else ylim(start), log=log)
    print_table(results, summary)
    return payload
