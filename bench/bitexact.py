"""Bit-exactness of a refactor: digests of parameters and state after a few steps.

    python bench/bitexact.py --out before.json          # on the old checkout
    python bench/bitexact.py --out after.json           # on the new one
    python bench/bitexact.py --compare before.json after.json

Each scenario builds a small model, trains it for a few steps with ``KFACPreconditioner``
+ SGD or ``kaisa.KFAC`` (every mode: fixed and adaptive, empirical and Monte-Carlo, each
compute method, AMP scaling, gradient accumulation, a checkpoint round trip) through the
public API only, and records the SHA-256 of every parameter's bytes and of the optimizer
and preconditioner state. Two checkouts agree bit for bit when every digest is equal.

The ``f64/`` scenarios (each product on the CNN and the MLP in float64) also record the
parameters' values: where a change may round differently (a reduction in another order),
``--compare`` accepts their digests differing when every value agrees to ``--rtol``
(relative to the largest magnitude of its tensor; 1e-12 by default) and says how closely.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kaisa

STEPS = 8


def _mlp(out: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, out)).to(dtype)


def _cnn(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
                         nn.Flatten(), nn.Linear(4 * 3 * 3, 5)).to(dtype)


def _data(step: int, *, image: bool = False, classes: int = 0, dtype: torch.dtype = torch.float32,
          out: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 2, 7, 7, generator=g) if image else torch.randn(16, 6, generator=g)
    if classes:
        return x.to(dtype), torch.randint(0, classes, (16,), generator=g)
    return x.to(dtype), torch.randn(16, out, generator=g).to(dtype)


def _digest(*objects: Any) -> str:
    h = hashlib.sha256()
    buf = io.BytesIO()
    for obj in objects:
        torch.save(_tensors(obj), buf)
    h.update(buf.getvalue())
    return h.hexdigest()


def _tensors(obj: Any) -> Any:
    """Tensors and numbers of a nested state, in a canonical order (no object identities)."""
    if isinstance(obj, torch.Tensor):  # its values only: a view is saved as its own copy
        return obj.detach().cpu().clone(memory_format=torch.contiguous_format)
    if isinstance(obj, dict):
        return [(str(k), _tensors(v)) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))]
    if isinstance(obj, (list, tuple)):
        return [_tensors(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(type(obj))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _result(model: nn.Module, state: Any, **extra: str) -> dict[str, Any]:
    """Digests of the parameters and ``state``; float64 parameters' values too."""
    out: dict[str, Any] = {"params": _digest(_params(model)), "state": _digest(state), **extra}
    params = _params(model)
    if all(p.dtype == torch.float64 for p in params):
        out["values"] = [p.flatten().tolist() for p in params]
    return out


def preconditioner(method: str, *, image: bool = False, accumulation: int = 1,
                   in_hook: bool = True, scaler: bool = False,
                   schedule: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    model = _cnn(dtype) if image else _mlp(dtype=dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaler else None
    pre = kaisa.KFACPreconditioner(
        model, compute_method=method, factor_update_steps=2 if schedule else 1,
        inv_update_steps=3, damping=(lambda s: 0.003 * (1 + s)) if schedule else 0.003,
        lr=0.05, accumulation_steps=accumulation, update_factors_in_hook=in_hook,
        grad_scaler=grad_scaler,
    )
    for step in range(STEPS):
        sgd.zero_grad()
        for micro in range(accumulation):
            x, y = _data(step * 10 + micro, image=image, classes=5 if image else 0,
                         dtype=dtype)
            out = model(x)
            loss = F.cross_entropy(out, y) if image else F.mse_loss(out, y)
            if grad_scaler is not None:
                grad_scaler.scale(loss).backward()
            else:
                loss.backward()
        if grad_scaler is not None:
            grad_scaler.unscale_(sgd)
        pre.step()
        if grad_scaler is not None:
            grad_scaler.step(sgd)
            grad_scaler.update()
        else:
            sgd.step()
    return _result(model, pre.state_dict())


def optimizer(*, loss: str = "mse", image: bool = False, closure: bool = True,
              resume: bool = False, scaler: bool = False, dtype: torch.dtype = torch.float32,
              **kw: Any) -> dict[str, Any]:
    classes = (5 if image else 4) if loss == "cross_entropy" else 0

    def build() -> tuple[nn.Module, kaisa.KFAC]:
        model = _cnn(dtype) if image else _mlp(dtype=dtype)
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaler else None
        return model, kaisa.KFAC(model, loss=loss, damping_interval=2, grad_scaler=grad_scaler,
                                 **kw)

    model, opt = build()

    def run(steps: range, model: nn.Module, opt: kaisa.KFAC) -> None:
        for step in steps:
            x, y = _data(step, image=image, classes=classes, dtype=dtype)
            if closure:
                opt.step(lambda x=x, y=y: (model(x), y))
            else:
                opt.zero_grad()
                out = model(x)
                value = F.cross_entropy(out, y) if classes else F.mse_loss(out, y)
                if opt.grad_scaler is not None:
                    value = opt.grad_scaler.scale(value)
                value.backward()
                opt.step()

    if resume:
        run(range(STEPS // 2), model, opt)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=False)
        model, opt = build()
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        run(range(STEPS // 2, STEPS), model, opt)
    else:
        run(range(STEPS), model, opt)
    return _result(model, opt.state_dict(), last=json.dumps(opt.last, sort_keys=True))


def ekfac(*, image: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``kaisa.EKFAC`` with its defaults (factors every step, bases every 10), lr 1e-2."""
    model = _cnn(dtype) if image else _mlp(dtype=dtype)
    opt = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=3)
    for step in range(STEPS):
        x, y = _data(step, image=image, classes=5 if image else 0, dtype=dtype)
        opt.zero_grad()
        out = model(x)
        (F.cross_entropy(out, y) if image else F.mse_loss(out, y)).backward()
        opt.step()
    return _result(model, opt.state_dict())


SCENARIOS: dict[str, Callable[[], dict[str, str]]] = {
    "pre/eigen": lambda: preconditioner("eigen"),
    "pre/inverse": lambda: preconditioner("inverse"),
    "pre/pi_inverse": lambda: preconditioner("pi_inverse"),
    "pre/eigen/cnn/accumulation": lambda: preconditioner("eigen", image=True, accumulation=2),
    "pre/eigen/not_in_hook/schedule": lambda: preconditioner("eigen", in_hook=False,
                                                             schedule=True),
    "pre/inverse/scaler": lambda: preconditioner("inverse", scaler=True),
    "kfac/adaptive/mc/mse": lambda: optimizer(),
    "kfac/adaptive/mc/ce/cnn/2samples": lambda: optimizer(loss="cross_entropy", image=True,
                                                          mc_samples=2),
    "kfac/adaptive/empirical": lambda: optimizer(curvature="empirical"),
    "kfac/adaptive/eigen": lambda: optimizer(compute_method="eigen"),
    "kfac/adaptive/scaler": lambda: optimizer(scaler=True),
    "kfac/adaptive/weight_decay/resume": lambda: optimizer(weight_decay=0.01, resume=True),
    "kfac/fixed/empirical/closure": lambda: optimizer(curvature="empirical", lr=0.1,
                                                      momentum=0.9),
    "kfac/fixed/empirical/no_closure": lambda: optimizer(curvature="empirical", lr=0.1,
                                                         momentum=0.9, closure=False),
    "kfac/fixed/mc/ce": lambda: optimizer(loss="cross_entropy", lr=0.1, momentum=0.5),
    "kfac/fixed/empirical/scaler/no_closure": lambda: optimizer(
        curvature="empirical", lr=0.1, momentum=0.9, closure=False, scaler=True),
    "f64/pre/eigen/cnn/accumulation": lambda: preconditioner(
        "eigen", image=True, accumulation=2, dtype=torch.float64),
    "f64/pre/inverse/mlp": lambda: preconditioner("inverse", dtype=torch.float64),
    "f64/kfac/adaptive/ce/cnn": lambda: optimizer(loss="cross_entropy", image=True,
                                                  dtype=torch.float64),
    "f64/ekfac/cnn": lambda: ekfac(image=True, dtype=torch.float64),
    "f64/ekfac/mlp": lambda: ekfac(dtype=torch.float64),
}


def _closeness(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Largest relative difference of the recorded values (``None``: not comparable)."""
    if "values" not in before or "values" not in after:
        return None
    if len(before["values"]) != len(after["values"]):
        return None
    worst = 0.0
    for b, a in zip(before["values"], after["values"], strict=True):
        if len(b) != len(a):
            return None
        tb, ta = torch.tensor(b, dtype=torch.float64), torch.tensor(a, dtype=torch.float64)
        if not bool(torch.isfinite(tb).all() and torch.isfinite(ta).all()):
            return None
        top = float(tb.abs().max()) if tb.numel() else 0.0
        worst = max(worst, float((ta - tb).abs().max()) / top if top > 0 else 0.0)
    return worst


def compare(before: dict[str, Any], after: dict[str, Any], rtol: float) -> int:
    """Prints SAME, CLOSE (float64 values within ``rtol``) or DIFFER per scenario."""
    failed = False
    for name in after:
        if before.get(name) == after[name]:
            print(f"SAME   {name}")
            continue
        close = None if name not in before else _closeness(before[name], after[name])
        if close is not None and close <= rtol:
            print(f"CLOSE  {name} (largest relative difference {close:.2e})")
            continue
        failed = True
        detail = "" if close is None else f" (largest relative difference {close:.2e})"
        print(f"DIFFER {name}{detail}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the digests here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--only", default="", help="run the scenarios starting with this")
    parser.add_argument("--rtol", type=float, default=1e-12,
                        help="float64 scenarios: the relative difference accepted")
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before, after, args.rtol)
    torch.set_num_threads(1)
    results = {name: fn() for name, fn in SCENARIOS.items() if name.startswith(args.only)}
    text = json.dumps(results, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
