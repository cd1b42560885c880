"""Training quality of warm-started eigenbases (``basis_refresh='qr'``) against ``'eigh'``.

``KFACPreconditioner(basis_refresh='qr', eigh_every=E)`` (eigen method) refreshes every
dense factor's eigenbasis on a decomposition step by one warm-started subspace-iteration
step from the stored eigenvectors, with a full ``eigh`` every ``E``-th decomposition step
(``docs/conventions.md``, "Warm-started eigenbases"). It is meant to be the cheaper
choice on GPUs; this script measures whether it trains as well as the default ``'eigh'``.

Two digits tasks (scikit-learn's embedded 8x8 digits, ``kaisa.train.data.load_digits``'s
fixed split: 1437 training and 360 validation images), each with ``kaisa-train``'s tuned
SGD + K-FAC values for the task (``kaisa.train.configs.TUNED``: SGD momentum 0.9, constant
lr 0.3; damping 0.03 for the autoencoder, 0.1 for the classifier; kfac-pytorch's defaults
otherwise: factor decay 0.95, kl_clip 0.001), batch 128, factors every step, and
``kaisa-train``'s epochs (100 autoencode, 20 classify; 12 steps an epoch):

* ``autoencode``: ``kaisa.train.models.autoencoder`` (64-256-128-64-16-64-128-256-64, tanh),
  MSE; targets: validation MSE 0.02, 0.015 and 0.012.
* ``classify``: ``kaisa.train.models.cnn`` (two 3x3 convolutions, max-pool, two linear
  layers), cross-entropy; targets: validation accuracy 0.95, 0.97 and 0.98.

Configurations: ``eigh`` and ``qr`` with ``eigh_every`` 10 and 5 at ``inv_update_steps=10``,
and ``eigh`` and ``qr`` with ``eigh_every`` 10 at ``inv_update_steps=1`` (every step a
decomposition step: nine warm steps in a row between full ones). Per seed every
configuration starts from the same weights and sees the same batches. After every epoch
the training and validation loss (and accuracy) on the whole sets; per run the final and
best values, the first step (evaluated every epoch) at which the validation metric reached
each target, and the seconds spent in ``update_decompositions`` (wall clock, single-threaded
CPU) as a share of the training loop's. Seeds 0 to 4 (weights and batch order; the split is
fixed).

    python bench/experiments/warm_bases_quality.py   # bench/results/warm_bases_quality.json
    python bench/experiments/warm_bases_quality.py --smoke --out /tmp/w.json   # seconds
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import kaisa
from bench import harness
from kaisa.train.data import load_digits
from kaisa.train.models import autoencoder, cnn

#: name -> (basis_refresh, eigh_every, inv_update_steps)
CONFIGS: dict[str, tuple[str, int, int]] = {
    "eigh inv/10": ("eigh", 10, 10),
    "qr eigh_every=10 inv/10": ("qr", 10, 10),
    "qr eigh_every=5 inv/10": ("qr", 5, 10),
    "eigh inv/1": ("eigh", 10, 1),
    "qr eigh_every=10 inv/1": ("qr", 10, 1),
}
#: task -> lr, damping, the metric the targets are on (accuracy: higher is better)
TASKS: dict[str, dict[str, Any]] = {
    "autoencode": {"lr": 0.3, "damping": 0.03, "metric": "val_loss",
                   "targets": [0.02, 0.015, 0.012]},
    "classify": {"lr": 0.3, "damping": 0.1, "metric": "val_acc", "targets": [0.95, 0.97, 0.98]},
}
BATCH = 128


def _evaluate(task: str, model: torch.nn.Module, x: torch.Tensor,
              y: torch.Tensor) -> tuple[float, float | None]:
    with torch.no_grad():
        if task == "autoencode":
            flat = x.flatten(1)
            return F.mse_loss(model(flat), flat).item(), None
        logits = model(x)
        return (F.cross_entropy(logits, y).item(),
                (logits.argmax(1) == y).float().mean().item())


def run(task: str, config: str, seed: int, epochs: int, data: Any) -> dict[str, Any]:
    """One training run; the curve per epoch and its summary."""
    refresh, eigh_every, ius = CONFIGS[config]
    spec = TASKS[task]
    torch.manual_seed(seed)
    model = autoencoder(input_dim=64) if task == "autoencode" else cnn()
    opt = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=0.9)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=ius,
                                   lr=spec["lr"], damping=spec["damping"],
                                   basis_refresh=refresh, eigh_every=eigh_every)
    curvature = pre.curvature
    update = curvature.update_decompositions
    decomposition = [0.0]

    def timed(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        out = update(*args, **kw)
        decomposition[0] += time.perf_counter() - start
        return out

    curvature.update_decompositions = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1000 + seed)
    x, y = data.train_x, data.train_y
    train_seconds, step, curve = 0.0, 0, []
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        model.train()
        start = time.perf_counter()
        for i in range(0, len(x), BATCH):
            idx = perm[i:i + BATCH]
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            if task == "autoencode":
                flat = xb.flatten(1)
                loss = F.mse_loss(model(flat), flat)
            else:
                loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            pre.step()
            opt.step()
            step += 1
        train_seconds += time.perf_counter() - start
        model.eval()
        train_loss, train_acc = _evaluate(task, model, x, y)
        val_loss, val_acc = _evaluate(task, model, data.test_x, data.test_y)
        curve.append({"epoch": epoch + 1, "step": step, "train_loss": train_loss,
                      "train_acc": train_acc, "val_loss": val_loss, "val_acc": val_acc})
    metric = spec["metric"]
    higher = metric.endswith("acc")
    hits: dict[str, int | None] = {}
    for target in spec["targets"]:
        at = [p["step"] for p in curve if p[metric] == p[metric]
              and (p[metric] >= target if higher else p[metric] <= target)]
        hits[f"{target:g}"] = at[0] if at else None
    pick = max if higher else min
    finite = [p for p in curve if p[metric] == p[metric]]
    return {
        "final": {k: curve[-1][k] for k in ("train_loss", "train_acc", "val_loss", "val_acc")},
        "best_val_loss": min((p["val_loss"] for p in finite), default=float("nan")),
        "best_val_acc": max((p["val_acc"] for p in finite if p["val_acc"] is not None),
                            default=None),
        "best_train_loss": min((p["train_loss"] for p in finite), default=float("nan")),
        "best_metric": pick(p[metric] for p in finite) if finite else None,
        "steps_to_target": hits,
        "train_seconds": train_seconds,
        "decomposition_seconds": decomposition[0],
        "decomposition_share": decomposition[0] / train_seconds if train_seconds else None,
        "curve": curve,
    }


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None and v == v]
    return statistics.fmean(vals) if len(vals) == len(values) and vals else None


def summarise(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per configuration the mean (and spread) over seeds of each summary number."""
    out: dict[str, Any] = {}
    for config, by_seed in runs.items():
        rs = list(by_seed.values())
        summary = {
            "final_val_loss": _mean([r["final"]["val_loss"] for r in rs]),
            "final_val_loss_range": [min(r["final"]["val_loss"] for r in rs),
                                     max(r["final"]["val_loss"] for r in rs)],
            "final_train_loss": _mean([r["final"]["train_loss"] for r in rs]),
            "best_val_loss": _mean([r["best_val_loss"] for r in rs]),
            "final_val_acc": _mean([r["final"]["val_acc"] for r in rs]),
            "best_val_acc": _mean([r["best_val_acc"] for r in rs]),
            "steps_to_target": {t: _mean([r["steps_to_target"][t] for r in rs])
                                for t in rs[0]["steps_to_target"]},
            "seeds_at_target": {t: sum(r["steps_to_target"][t] is not None for r in rs)
                                for t in rs[0]["steps_to_target"]},
            "decomposition_share": _mean([r["decomposition_share"] for r in rs]),
        }
        out[config] = summary
    return out


def table(results: dict[str, Any]) -> str:
    """A Markdown table: per task and configuration the seed means (and per seed values)."""
    lines = ["| task | configuration | final val loss (per seed) | best val loss | final train loss"
             " | final val acc | best val acc | steps to targets (per seed) | decomposition share"
             " |",
             "|---|---|---|---|---|---|---|---|---|"]
    for task, by_config in results["tasks"].items():
        for config, by_seed in by_config["runs"].items():
            s = by_config["summary"][config]
            per_loss = " / ".join(f"{r['final']['val_loss']:.4f}" for r in by_seed.values())
            acc = "" if s["final_val_acc"] is None else f"{s['final_val_acc']:.3f}"
            best = "" if s["best_val_acc"] is None else f"{s['best_val_acc']:.3f}"
            hit = "; ".join(
                f"{t}: {'-' if m is None else f'{m:.0f}'} ("
                + " / ".join(str(r["steps_to_target"][t] or "-") for r in by_seed.values()) + ")"
                for t, m in s["steps_to_target"].items())
            share = ("" if s["decomposition_share"] is None
                     else f"{100 * s['decomposition_share']:.0f}%")
            lines.append(f"| {task} | {config} | {s['final_val_loss']:.4f} ({per_loss}) | "
                         f"{s['best_val_loss']:.4f} | {s['final_train_loss']:.4f} | {acc} | "
                         f"{best} | {hit} | {share} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__doc__, harness.RESULTS / "warm_bases_quality.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--epochs-autoencode", type=int, default=100)
    parser.add_argument("--epochs-classify", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one seed, two epochs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.smoke:
        args.seeds, args.epochs_autoencode, args.epochs_classify = [0], 2, 2
    data = load_digits()
    epochs = {"autoencode": args.epochs_autoencode, "classify": args.epochs_classify}
    tasks: dict[str, Any] = {}
    for task in args.tasks:
        runs: dict[str, dict[str, Any]] = {c: {} for c in args.configs}
        for seed in args.seeds:
            for config in args.configs:
                r = run(task, config, seed, epochs[task], data)
                runs[config][str(seed)] = r
                print(f"{task} seed {seed} {config:24s}: final val loss "
                      f"{r['final']['val_loss']:.4f} acc {r['final']['val_acc']} "
                      f"best {r['best_metric']:.4f} steps to targets {r['steps_to_target']} "
                      f"decomp {100 * (r['decomposition_share'] or 0):.0f}% "
                      f"({r['train_seconds']:.1f} s)", flush=True)
        tasks[task] = {**TASKS[task], "epochs": epochs[task],
                       "steps_per_epoch": -(-len(data.train_x) // BATCH),
                       "summary": summarise(runs), "runs": runs}
    payload = {"configs": {k: dict(zip(("basis_refresh", "eigh_every", "inv_update_steps"), v))
                           for k, v in CONFIGS.items() if k in args.configs},
               "seeds": args.seeds, "batch": BATCH, "factor_update_steps": 1,
               "momentum": 0.9, "tasks": tasks}
    results = harness.write(args.out, "warm_bases_quality", payload, argv)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
