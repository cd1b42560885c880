"""load_state_dict of KFACPreconditioner and kaisa.KFAC: everything checked, then loaded
all or nothing (docs/reliability.md)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

pytestmark = pytest.mark.usefixtures("float64")


def _mlp(width: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _nan_factor(state: dict[str, Any]) -> None:
    state["layers"]["0"]["A"][0, 0, 0] = float("nan")


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.__setitem__(key, value)


# Each corruption of a saved state, with what the error names.
CORRUPT: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "damping -1": (_set("damping", -1), r"state_dict damping must be in \(0.0, inf\], got -1"),
    "damping 'abc'": (_set("damping", "abc"), "damping must be a number.*'abc'"),
    "steps '5'": (_set("steps", "5"), "state_dict steps must be an integer >= 0, got '5'"),
    "factor_update_steps 0": (_set("factor_update_steps", 0), "factor_update_steps"),
    "NaN running factor": (_nan_factor, "state_dict layer '0': A is not finite"),
    "layers a list": (_set("layers", []), "layers is a list"),
    "unknown entry": (lambda s: s["layers"]["2"].__setitem__("bogus", torch.ones(1)),
                      r"layer '2' has unexpected entries \['bogus'\]"),
    "skip count": (lambda s: s["layers"]["2"].__setitem__("skipped_g", torch.tensor(0.5)),
                   "skipped_g must be a count"),
}


def _trained_preconditioner(model: nn.Module) -> kaisa.KFACPreconditioner:
    pre = kaisa.KFACPreconditioner(model, damping=0.01)
    x, y = _batch()
    F.mse_loss(model(x), y).backward()
    pre.step()
    return pre


@pytest.mark.parametrize("case", CORRUPT)
def test_preconditioner_rejects_a_malformed_state_and_loads_nothing(case: str) -> None:
    corrupt, message = CORRUPT[case]
    saved = copy.deepcopy(_trained_preconditioner(_mlp()).state_dict())
    corrupt(saved)
    target = _trained_preconditioner(_mlp())
    target.set_schedule("damping", 0.02)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)


def test_preconditioner_rejects_layers_of_another_size() -> None:
    saved = _trained_preconditioner(_mlp(width=5)).state_dict()  # same names, other sizes
    target = _trained_preconditioner(_mlp())
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=r"layer '0': G has shape \(1, 5, 5\), this layer's "
                                         r"is \(1, 4, 4\)"):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)


def _trained_kfac(model: nn.Module, steps: int = 2) -> kaisa.KFAC:
    opt = kaisa.KFAC(model, loss="mse", damping_interval=1)
    x, y = _batch()
    for _ in range(steps):
        opt.step(lambda: (model(x), y))
    return opt


KFAC_CORRUPT: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "damping 'abc'": (lambda s: s["kaisa"].__setitem__("damping", "abc"),
                      "state_dict damping must be a finite number > 0, got 'abc'"),
    "damping -1": (lambda s: s["kaisa"].__setitem__("damping", -1.0), "damping"),
    "steps '5'": (lambda s: s["kaisa"].__setitem__("steps", "5"), "steps.*'5'"),
    "preconditioner steps '5'": (
        lambda s: s["kaisa"]["preconditioner"].__setitem__("steps", "5"),
        "preconditioner steps must be an integer >= 0, got '5'"),
    "preconditioner steps differ": (
        lambda s: s["kaisa"]["preconditioner"].__setitem__("steps", 7),
        r"preconditioner steps \(7\) differ"),
    "NaN running factor": (lambda s: _nan_factor(s["kaisa"]["preconditioner"]),
                           "layer '0': A is not finite"),
    "factor_decay 2": (lambda s: s["kaisa"]["preconditioner"].__setitem__("factor_decay", 2.0),
                       "factor_decay"),
    "generator": (lambda s: s["kaisa"].__setitem__("generator", torch.zeros(3)), "generator"),
    "velocity shape": (lambda s: s["state"][0].__setitem__("velocity", torch.zeros(2, 2)),
                       r"velocity of parameter 0 is \(2, 2\).*\(4, 3\)"),
    "NaN velocity": (lambda s: s["state"][1]["velocity"].fill_(float("nan")), "not finite"),
    "no kaisa entry": (lambda s: s.pop("kaisa"), "no 'kaisa' entry"),
}


@pytest.mark.parametrize("case", KFAC_CORRUPT)
def test_kfac_rejects_a_malformed_state_and_loads_nothing(case: str) -> None:
    corrupt, message = KFAC_CORRUPT[case]
    saved = copy.deepcopy(_trained_kfac(_mlp()).state_dict())
    corrupt(saved)
    model = _mlp()
    target = _trained_kfac(model, steps=1)  # torch's part differs: loading it would show
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)


def test_kfac_rejects_layers_of_another_size_and_keeps_going() -> None:
    saved = _trained_kfac(_mlp(width=5)).state_dict()
    model = _mlp()
    target = _trained_kfac(model, steps=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=r"layer '0': G has shape \(1, 5, 5\)"):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)
    x, y = _batch()
    target.step(lambda: (model(x), y))  # still usable
