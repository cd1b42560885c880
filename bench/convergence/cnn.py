"""Optimisers on ResNet-32 with CIFAR shapes: scikit-learn's digits as 3x32x32 images.

One run, one seed: every optimiser starts from the same initial weights and sees the
same batches. The 1797 8x8 digits (embedded in scikit-learn, no download) are split
by the seed into 1437 training and 360 validation images (stratified), upsampled
bilinearly to 32x32, repeated over 3 channels and normalised by the training set's
mean and standard deviation: ResNet-32 (He et al. 2016, option-A shortcuts,
``kaisa.train.models.resnet32``) then runs at CIFAR-10's shapes and cost. A training batch is
a function of (seed, step) (``--batch`` images drawn without replacement). Validation
loss (cross-entropy) and accuracy on the 360 images (BatchNorm in eval mode) every
``--eval-every`` steps, against step and against training seconds (evaluation
excluded). Single-threaded; the configurations train in lockstep (``bench/convergence/compare.py``),
so the per-step cost ratio to AdamW is one of median step times.

Configurations (``--only`` picks some; the machinery is ``bench/convergence/compare.py``'s):

* ``adamw@lr`` for lr 1e-3, 3e-3, 1e-2 (the best is reported as "AdamW").
* ``muon``: ``torch.optim.Muon`` (lr 0.2) on every convolution's filters, flattened to
  ``(out, in * 3 * 3)`` (Keller Jordan's recipe for CIFAR ResNets), AdamW (1e-2) for the
  classifier and the BatchNorm weights and biases.
* ``soap``: ``bench/convergence/soap.py`` (lr 1e-2, betas (0.95, 0.95), basis every 10 steps), the
  convolution filters as ``(out, in * 3 * 3)`` matrices (the classifier's weight 2-D;
  BatchNorm and bias vectors plain Adam).
* ``adamw+kfac``: ``kaisa.KFACPreconditioner`` (damping 0.03, factors every step,
  inverses every 10, convolutions and the classifier) + AdamW 1e-2. Not in the default
  run: its validation loss spikes early (1.6e3 at step 20 in an aborted 32x32 run,
  training loss 0.86). The spike is BatchNorm's running statistics (eval mode) lagging
  weights that move fast at the warmup's peak lr, not K-FAC: plain AdamW at the same lr
  spikes too (``--only adamw+kfac,adamw@1e-2 --steps 40 --eval-every 10``: validation
  loss at steps 10/20/30/40 AdamW 31.1/201.4/26.5/0.49, adamw+kfac 42.3/495.6/122.3/6.04;
  training losses 0.58 and 0.71 at step 20). adamw+kfac recovers more slowly; its lr was
  never tuned for this task.
* ``ekfac@lr`` for lr 3e-3, 1e-2, 3e-2: ``kaisa.EKFAC`` (AdamW's betas and eps, factors every
  step, eigenbases by ``eigh`` every 10 steps), and ``ekfac-f5-b95@1e-2`` (the GPT's fast
  recipe: factors every 5 steps with decay 0.95**5, beta2 0.95; ``bench/convergence/compare.py``).
* ``kfac``: ``kaisa.KFAC(model, loss="cross_entropy")`` with its defaults (adaptive lr
  and momentum: no schedule, no clipping).

The learning rates are each optimiser's best of a grid that brackets it, from short runs
at 16x16 images (``bench/results/cnn_lr_tuning_16px.json``, ``docs/training.md``).
The lr-based ones use warmup 20 steps then cosine to 10%, gradient clipping at norm
1.0 (before preconditioning) and weight decay 0.1 on the convolution filters and the
classifier's weight (AdamW, Muon, SOAP, EKFAC), as ``bench/convergence/gpt.py`` does.

    python bench/convergence/cnn.py                       # 150 steps, batch 32, 32x32
    python bench/convergence/cnn.py --tiny --steps 3 --out /tmp/cnn.json  # smoke (8x8, batch 4)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.train.data import load_digits
from kaisa.train.models import resnet32

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import Recipe, Task, compare

RESULTS = Path(__file__).resolve().parents[1] / "results"
ADAMW_GRID = (1e-3, 3e-3, 1e-2)
EKFAC_GRID = (3e-3, 1e-2, 3e-2)
CONFIGS = (
    *(f"adamw@{lr:g}" for lr in ADAMW_GRID), "muon", "soap", "kfac",
    *(f"ekfac@{lr:g}" for lr in EKFAC_GRID), "ekfac-f5-b95@0.01",
)
RECIPE = Recipe(
    muon_params=lambda _name, p: p.ndim == 4,
    decayed=lambda _name, p: p.ndim >= 2,
    muon_lr=0.2, muon_adamw_lr=1e-2, soap_lr=1e-2, soap_flatten=True,
    kfac_adamw_lr=1e-2, kfac_damping=0.03, kfac_layer_kinds=("linear", "conv2d"),
)


class Digits:
    """The digits as normalised ``(N, 3, size, size)`` images; batches by (seed, step).

    Args:
        size: Image side (8: the original images; else bilinear upsampling).
        batch: Training images per step.
        seed: Seed of the split and of the batches.
    """

    def __init__(self, *, size: int, batch: int, seed: int) -> None:
        data = load_digits(seed=seed)
        train, val = (self._images(x, size) for x in (data.train_x, data.test_x))
        mean, std = train.mean(), train.std()
        self.train_x, self.val_x = (train - mean) / std, (val - mean) / std
        self.train_y, self.val_y = data.train_y, data.test_y
        if not 1 <= batch <= len(self.train_x):
            raise ValueError(f"batch must be in [1, {len(self.train_x)}], got {batch}")
        self.batch_size, self.seed = batch, seed

    @staticmethod
    def _images(x: torch.Tensor, size: int) -> torch.Tensor:
        if size != x.shape[-1]:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        return x.expand(-1, 3, -1, -1).contiguous()

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training step ``step``'s images and labels."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        index = torch.randperm(len(self.train_x), generator=generator)[: self.batch_size]
        return self.train_x[index], self.train_y[index]

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict[str, float]:
        """Mean cross-entropy and accuracy over the validation images (eval mode)."""
        model.eval()
        loss, correct = 0.0, 0
        for start in range(0, len(self.val_x), 120):
            out = model(self.val_x[start : start + 120])
            y = self.val_y[start : start + 120]
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
        model.train()
        return {"val_loss": loss / len(self.val_y), "val_accuracy": correct / len(self.val_y)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the comparison; write JSON (and the plot); return the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32, help="image side (8: no upsampling)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(CONFIGS), help="comma-separated configs")
    parser.add_argument("--tiny", action="store_true", help="smoke size: 8x8 images, batch 4")
    parser.add_argument("--out", type=Path, default=RESULTS / "cnn.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.size, args.batch, args.eval_every = 8, 4, max(1, args.steps // 2)
    torch.set_num_threads(1)
    data = Digits(size=args.size, batch=args.batch, seed=args.seed)
    torch.manual_seed(args.seed)
    init = resnet32().state_dict()
    task = Task(make_model=resnet32, batch=data.batch, validate=data.validate, recipe=RECIPE,
                steps=args.steps, eval_every=args.eval_every)
    head = {
        "benchmark": "bench/convergence/cnn.py", "argv": argv,
        "settings": vars(args) | {"out": str(args.out)},
        "data": {"train_images": len(data.train_x), "validation_images": len(data.val_x),
                 "shape": list(data.train_x.shape[1:])},
    }
    title = None if args.no_plot else (
        f"ResNet-32, digits at {args.size}x{args.size}x3, batch {args.batch}, "
        f"{args.steps} steps (1 thread)")
    return compare(task, [n for n in args.only.split(",") if n], init, head, args.out,
                   title=title, ylabel="validation loss (cross-entropy)", log=True)


if __name__ == "__main__":
    main()
