"""Operator calls per step phase: each K-FAC product against SGD, fused AdamW and Muon.

On a GPU every operator call is at least one kernel launch and ~10-20 us of eager overhead,
so a step of many small calls is launch-bound whatever its arithmetic. This counts, on the
CPU, the calls each phase of a step dispatches (a ``TorchDispatchMode``: every call that
reaches the dispatcher, views included, as ``docs/benchmarks.md`` counts them), for

* ResNet-50 (ImageNet layout at 32 px, batch 2), the CIFAR ResNet-32 of
  ``bench/step_cost/step_cost.py`` (batch 8) and the byte GPT (d 128, 4 layers, context 64,
  batch 2);
* ``sgd`` (momentum, foreach), ``adamw`` (``fused=True``), ``muon`` (``torch.optim.Muon`` on
  the matrices, convolution filters as ``(out, -1)`` views, fused AdamW for the rest);
* ``kfac_pre``: ``kaisa.KFACPreconditioner`` with factors every 10 steps and decompositions
  every 100 (its phases count its ``step()`` alone; ``step_sgd`` and the like the SGD step
  after it); ``ekfac``: ``kaisa.EKFAC`` with its defaults (factors every step,
  bases every 10); ``kfac``: ``kaisa.KFAC`` (its ``step(closure)`` runs the forward and
  backward passes itself, so its phase ``step`` is the whole iteration); ``kfac_muon_input``
  and ``kfac_muon_eigen``: ``kaisa.KFACMuon`` with ``curvature`` ``'input'`` or ``'eigen'``
  and its defaults (factors every step, a refresh every 10).

Phases: ``fwd_bwd`` (forward + backward of a step that records nothing), ``fwd_bwd_factor``
(of a step whose hooks record statistics), ``step`` (the optimizer or product step of a
plain step: no factor or decomposition work; EKFAC's steady step, which folds factors),
``step_factor`` (factors, no decomposition)
and ``step_decomposition`` (the step that decomposes). Besides ``calls``, ``launches``
counts each of kaisa's own operators as the CUDA kernels it launches at least
(``KAISA_LAUNCHES``); torch's operators count one each.

    python bench/step_cost/launches.py                        # writes bench/results/launches.json
    python bench/step_cost/launches.py --smoke --out /tmp/l.json   # CI: small models
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
import kaisa
from bench import harness
from kaisa.train import models
from kaisa.train.models.gpt import gpt

#: CUDA kernels one call of a kaisa operator launches at least (``csrc/cuda``):
#: ``eigen_precondition`` four cuBLAS GEMMs and its scaling kernel; a covariance its fused
#: kernel (and on CUDA the ``aminmax`` of its overflow guard, which on the CPU is a call
#: of its own, counted there); ``batched_eigh`` one solver call (more for large or mixed
#: batches); ``fold`` a fill of its flags and its two multi-tensor kernels (for up to 8
#: factors a call: a block's A and G are one call).
KAISA_LAUNCHES = {"kaisa.eigen_precondition": 5, "kaisa.covariance": 1,
                  "kaisa.conv_covariance": 1, "kaisa.batched_eigh": 1,
                  "kaisa.batched_eigh_status": 1, "kaisa.fold": 3}
PRODUCTS = ("sgd", "adamw", "muon", "kfac_pre", "ekfac", "kfac", "kfac_muon_input",
            "kfac_muon_eigen")


class Calls(TorchDispatchMode):
    """Every operator call that reaches the dispatcher (views included), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.by_op[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> dict[str, int]:
        """``calls`` and ``launches`` (kaisa's operators at :data:`KAISA_LAUNCHES`)."""
        calls = sum(self.by_op.values())
        extra = sum((KAISA_LAUNCHES.get(op, 1) - 1) * n for op, n in self.by_op.items())
        return {"calls": calls, "launches": calls + extra}


def task(name: str, smoke: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor, bool]:
    """``(model, inputs, targets, is_lm)`` of a task (small versions with ``smoke``)."""
    torch.manual_seed(0)
    if name == "resnet50":
        model: nn.Module = models.resnet50(num_classes=10)
        side = 32
        return model, torch.randn(2, 3, side, side), torch.randint(0, 10, (2,)), False
    if name == "resnet32":
        model = models.resnet20(num_classes=10) if smoke else models.resnet32(num_classes=10)
        side = 8 if smoke else 32
        return model, torch.randn(8, 3, side, side), torch.randint(0, 10, (8,)), False
    d, layers, context = (32, 2, 16) if smoke else (128, 4, 64)
    model = gpt(d_model=d, n_layers=layers, context=context, n_heads=4)
    tokens = torch.randint(0, 256, (2, context + 1))
    return model, tokens[:, :-1], tokens[:, 1:], True


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lm: bool) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]) if lm else out, y.reshape(-1))


class _Muon:
    """``torch.optim.Muon`` on the matrices (more-than-2-D ones as ``(out, -1)`` views)."""

    def __init__(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        mats = [p for p in params if p.ndim >= 2 and not isinstance(p, nn.Embedding)]
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        mats = [p for p in mats if id(p) not in embeddings]
        ids = {id(p) for p in mats}
        self.views = [(p, p.detach().view(p.shape[0], -1)) for p in mats]
        self.muon = torch.optim.Muon([v for _, v in self.views], lr=0.05)
        self.adamw = torch.optim.AdamW([p for p in params if id(p) not in ids], fused=True)

    def step(self) -> None:
        for p, v in self.views:
            v.grad = None if p.grad is None else p.grad.view(v.shape)
        self.muon.step()
        self.adamw.step()


def _phases(product: str, name: str, smoke: bool) -> dict[str, dict[str, int]]:
    """Counts of each phase of ``product`` on task ``name``."""
    model, x, y, lm = task(name, smoke)
    params = list(model.parameters())
    out: dict[str, dict[str, int]] = {}

    def count(phase: str, fn: Callable[[], object]) -> None:
        calls = Calls()
        with calls:
            fn()
        out[phase] = calls.totals()

    def fwd_bwd() -> None:
        _loss(model, x, y, lm).backward()

    if product == "kfac":
        opt = kaisa.KFAC(model, loss="cross_entropy", reduction="mean")

        def closure() -> tuple[torch.Tensor, torch.Tensor]:
            logits = model(x)
            return logits.reshape(-1, logits.shape[-1]) if lm else logits, y.reshape(-1)

        count("step_decomposition", lambda: opt.step(closure))
        count("step", lambda: opt.step(closure))
        return out
    # A step's parts: the product's step, then (for the preconditioner) the optimizer's.
    parts: list[tuple[str, Callable[[], object]]]
    if product == "sgd":
        parts = [("", torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True).step)]
    elif product == "adamw":
        parts = [("", torch.optim.AdamW(params, fused=True).step)]
    elif product == "muon":
        parts = [("", _Muon(model).step)]
    elif product == "kfac_pre":
        pre = kaisa.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
        parts = [("", pre.step),
                 ("_sgd", torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True).step)]
    elif product.startswith("kfac_muon_"):
        mode = product.removeprefix("kfac_muon_")
        parts = [("", kaisa.KFACMuon(model, lr=0.05, curvature=mode).step)]
    else:
        parts = [("", kaisa.EKFAC(model, lr=1e-3).step)]
    # Which iterations are counted, and as which phases (the others run uncounted).
    counted = {
        "kfac_pre": {0: ("fwd_bwd_factor", "step_decomposition"), 1: ("fwd_bwd", "step"),
                     10: ("fwd_bwd_factor", "step_factor")},
        # factors every step: the steady step is a factor step (the third: the first
        # creates Adam's moments, the second stacks them with the bases)
        "ekfac": {0: ("fwd_bwd_factor", "step_decomposition"), 2: ("fwd_bwd_factor", "step")},
        # the same schedule (factors every step, a refresh every 10): the third step has
        # its momentum or moments stacked
        "kfac_muon_input": {0: ("fwd_bwd_factor", "step_decomposition"),
                            2: ("fwd_bwd_factor", "step")},
        "kfac_muon_eigen": {0: ("fwd_bwd_factor", "step_decomposition"),
                            2: ("fwd_bwd_factor", "step")},
    }.get(product, {1: ("fwd_bwd", "step")})  # the first step of Adam allocates its state
    for i in range(max(counted) + 1):
        model.zero_grad()
        if i in counted:
            fb, st = counted[i]
            count(fb, fwd_bwd)
            for suffix, fn in parts:
                count(st + suffix, fn)
        else:
            fwd_bwd()
            for _, fn in parts:
                fn()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Counts every product's phases on every task; writes the JSON."""
    p = harness.parser(__doc__, harness.RESULTS / "launches.json")
    p.add_argument("--smoke", action="store_true", help="small models (CI)")
    p.add_argument("--tasks", default=None, help="default resnet50,resnet32,gpt "
                   "(with --smoke: resnet32,gpt, smaller)")
    p.add_argument("--products", default=",".join(PRODUCTS))
    args = p.parse_args(argv)
    results: dict[str, dict[str, Any]] = {}
    tasks = args.tasks or ("resnet32,gpt" if args.smoke else "resnet50,resnet32,gpt")
    for name in tasks.split(","):
        results[name] = {}
        for product in args.products.split(","):
            results[name][product] = _phases(product, name, args.smoke)
            print(name, product, results[name][product], flush=True)
    harness.write(args.out, "launches", {"smoke": args.smoke, "results": results},
                  argv=argv, script="bench/step_cost/launches.py", indent=1)
    return results


if __name__ == "__main__":
    main()
