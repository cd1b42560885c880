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
* ``muon@lr``: the same at Muon lr ``lr`` (the anchors' grid: 0.02, 0.05, 0.1).
* ``soap``: ``bench/convergence/soap.py`` (lr 1e-2, betas (0.95, 0.95), basis every 10 steps).
* ``klshampoo@lr``: ``bench/convergence/kl_shampoo.py`` (Lin et al., ICLR 2026: Shampoo's factors
  fitted by KL minimisation, no Adam grafting; betas (0.9, 0.95), bases every 10 steps;
  the anchors' grid: 3e-3, 1e-2, 3e-2).
* ``kfac-muon-MODE@lr``: ``kaisa.KFACMuon`` (``curvature`` ``input``, ``eigen`` or
  ``identity``; ``-rK`` factors from ``K`` rows of each call) on Muon's matrices, AdamW as
  Muon's for the rest.
* ``kfac``: ``kaisa.KFAC(model, loss="cross_entropy")`` with its defaults, and
  ``kfac@damping=0.1`` (kaisa-train's ``--task lm`` default: damping 0.1, inverses
  every 5, ``pi_inverse``), and ``kfac-reduce`` (defaults with KFAC-reduce factor
  statistics). Adaptive lr and momentum: no schedule, no clipping.
* ``ekfac[-OPTION...]@lr``: ``kaisa.EKFAC`` (eigenbases by ``eigh`` every 10 steps), with
  AdamW's betas and eps and factors every step unless an option says otherwise: ``fK``
  factors every K steps with ``factor_decay`` 0.95**K (the running average's horizon kept
  in steps), ``bNN`` beta2 0.NN, ``qr`` bases refreshed by a warm-started QR step
  (``eigh`` every 10th refresh), ``reduce`` KFAC-reduce factor statistics (one row per
  sequence instead of one per token; ``docs/conventions.md``), ``rK`` factor statistics
  from ``K`` random rows of each call (``factor_rows``), ``oK`` one-sided bases: sides
  above dimension ``K`` kept diagonal and unrotated (``max_basis_dim``), ``graft`` / ``rms``
  learning-rate transfer rules (``bench/convergence/ekfac_transfer.py``). The default run has
  ``ekfac@3e-3`` (AdamW's recipe unchanged), ``ekfac-b95@1e-2``, ``ekfac-f5-b95@1e-2`` and
  ``ekfac-f5-b95@3e-3``.
* ``adamw+kfac``: ``kaisa.KFACPreconditioner`` (damping 0.03, factors every step,
  inverses every 10) + AdamW 3e-3.

Every configuration trains in lockstep with the others (step ``i`` of each before step
``i + 1`` of any, the order rotated every step), so changes in the machine's load fall on
all alike; the per-step cost is the ratio of median step times.

The lr-based ones use warmup 20 steps then cosine to 10%, gradient clipping at norm
1.0 (before preconditioning) and weight decay 0.1 on matrices (AdamW, Muon, SOAP, EKFAC).

    python bench/convergence/gpt.py                       # 300 steps, context 64, batch 32, d 128
    python bench/convergence/gpt.py --wide --only adamw@0.003,klshampoo@0.01  # d 256 x 6, ctx 128
    python bench/convergence/gpt.py --tiny --steps 3 --out /tmp/gpt.json   # smoke test
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.train.models.gpt import gpt
from kaisa.train.text import load_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import Recipe, Task, compare

RESULTS = Path(__file__).resolve().parents[1] / "results"
ADAMW_GRID = (3e-4, 1e-3, 3e-3)
CONFIGS = (
    *(f"adamw@{lr:g}" for lr in ADAMW_GRID), "muon", "soap", "kfac", "ekfac@0.003",
    "ekfac-b95@0.01", "ekfac-f5-b95@0.01", "ekfac-f5-b95@0.003",
)
EXTRA_CONFIGS = ("adamw+kfac", "kfac@damping=0.1", "kfac-reduce", "ekfac-qr@0.003")
#: The anchors' grids: KL-Shampoo and Muon at three learning rates each.
KLSHAMPOO_GRID = (3e-3, 1e-2, 3e-2)
MUON_GRID = (0.02, 0.05, 0.1)
ANCHOR_CONFIGS = (*(f"klshampoo@{lr:g}" for lr in KLSHAMPOO_GRID),
                  *(f"muon@{lr:g}" for lr in MUON_GRID),
                  "kfac-muon-input@0.05", "kfac-muon-eigen@0.05")


RECIPE = Recipe(
    # Muon on the 2-D matrices inside the blocks; every Kronecker kind under adamw+kfac:
    # Linear, the attention projections, the tied embedding/head block
    # (KFACPreconditioner's default is kfac-pytorch's two)
    muon_params=lambda name, p: p.ndim == 2 and name.startswith("blocks."),
    muon_lr=0.05, muon_adamw_lr=3e-3, soap_lr=1e-2, kfac_adamw_lr=3e-3, kfac_damping=0.03,
    kfac_layer_kinds=("linear", "attention", "embedding"),
    loss=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
)


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
                        help="comma-separated configs (also: "
                        + ",".join(EXTRA_CONFIGS + ANCHOR_CONFIGS) + ")")
    parser.add_argument("--wide", action="store_true",
                        help="wider GPT: d 256, 6 layers, 8 heads, context 128, batch 16 "
                        "(the same 2048 tokens per step)")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke size: d 32, 2 layers, context 16, batch 4, 8 eval windows")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpt.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.wide:
        args.d_model, args.layers, args.heads, args.context, args.batch = 256, 6, 8, 128, 16
    if args.tiny:
        args.d_model, args.layers, args.context, args.batch = 32, 2, 16, 4
        args.eval_windows, args.eval_every = 8, max(1, args.steps // 2)
    torch.set_num_threads(1)
    data = load_text(context=args.context, examples_per_epoch=args.batch,
                     max_bytes=args.text_bytes, eval_windows=args.eval_windows, seed=args.seed)
    torch.manual_seed(args.seed)
    make_model = partial(gpt, d_model=args.d_model, context=args.context,
                         n_layers=args.layers, n_heads=args.heads)
    init = make_model().state_dict()
    every = torch.arange(args.batch)
    task = Task(
        make_model=make_model,
        batch=lambda index: data.batch(every, index),
        validate=lambda model: {"val_loss": validate(model, data.test_x, data.test_y)},
        recipe=RECIPE, steps=args.steps, eval_every=args.eval_every,
    )
    head = {
        "benchmark": "bench/convergence/gpt.py", "argv": argv,
        "settings": vars(args) | {"out": str(args.out)},
        "corpus_bytes": {"train": len(data.train_stream), "validation_windows": len(data.test_x)},
    }
    title = None if args.no_plot else (
        f"byte GPT d{args.d_model} x{args.layers}, context {args.context}, batch "
        f"{args.batch}, {args.steps} steps, stdlib text (1 thread)")
    return compare(task, [n for n in args.only.split(",") if n], init, head, args.out,
                   title=title, ylabel="validation loss (nats per byte)",
                   ylim=lambda start: (1.0, min(start, 4.0)))


if __name__ == "__main__":
    main()
