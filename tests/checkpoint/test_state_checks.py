"""Every field of each product's state dict is checked before anything loads.

For :class:`kaisa.KFACPreconditioner`, :class:`kaisa.EKFAC` and :class:`kaisa.KFAC` a
trained product's state is corrupted one field at a time (a string or a float where an
integer belongs, a missing entry, a tensor of the wrong shape or dtype, a nested value of
the wrong type, an entry no product writes): ``load_state_dict`` raises ``ValueError``
naming the field, and the target's state is unchanged (compared entry by entry).
"""

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

Corrupt = Callable[[dict[str, Any]], None]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


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


def _preconditioner(steps: int) -> kaisa.KFACPreconditioner:
    model = _mlp()
    pre = kaisa.KFACPreconditioner(model, damping=0.01)
    x, y = _batch()
    for _ in range(steps):
        F.mse_loss(model(x), y).backward()
        pre.step()
    return pre


def _ekfac(steps: int) -> kaisa.EKFAC:
    model = _mlp()
    opt = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=1)
    x, y = _batch()
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return opt


def _kfac(steps: int) -> kaisa.KFAC:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", damping_interval=1)
    x, y = _batch()
    for _ in range(steps):
        opt.step(lambda: (model(x), y))
    return opt


def _set(path: tuple[Any, ...], value: object) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = value
    return corrupt


def _pop(path: tuple[Any, ...]) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        del state[path[-1]]
    return corrupt


def _retype(path: tuple[Any, ...], change: Callable[[torch.Tensor], torch.Tensor]) -> Corrupt:
    def corrupt(state: dict[str, Any]) -> None:
        for key in path[:-1]:
            state = state[key]
        state[path[-1]] = change(state[path[-1]])
    return corrupt


PRECONDITIONER: dict[str, tuple[Corrupt, str]] = {
    "steps '5'": (_set(("steps",), "5"), "steps must be an integer >= 0, got '5'"),
    "steps 5.0": (_set(("steps",), 5.0), "steps must be an integer >= 0, got 5.0"),
    "no steps": (_pop(("steps",)), "no 'steps' entry"),
    "damping '0.1'": (_set(("damping",), "0.1"), "damping must be a number"),
    "A of another shape": (_set(("layers", "0", "A"), torch.zeros(1, 3, 3)),
                           r"layer '0': A has shape \(1, 3, 3\)"),
    "A of integers": (_retype(("layers", "0", "A"), torch.Tensor.long),
                      "layer '0': A must be a floating-point tensor"),
    "a layer a list": (_set(("layers", "0"), []), "layer '0' is a list"),
    "an unknown entry": (_set(("bogus",), 1), r"unexpected entries \['bogus'\]"),
}

EKFAC: dict[str, tuple[Corrupt, str]] = {
    "steps '5'": (_set(("kaisa", "steps"), "5"), "steps must be an integer >= 0, got '5'"),
    "refreshes 5.0": (_set(("kaisa", "refreshes"), 5.0), "refreshes must be an integer"),
    "no refreshes": (_pop(("kaisa", "refreshes")), "refreshes must be an integer"),
    "moment of another shape": (_set(("kaisa", "layers", "0", "exp_avg"), torch.zeros(3)),
                                r"layer '0': exp_avg has shape \(3,\)"),
    "layers a list": (_set(("kaisa", "layers"), []), "layers is a list"),
    "an unknown entry": (_set(("kaisa", "bogus"), 1), r"unexpected entries \['bogus'\]"),
    "lr a string": (_set(("param_groups", 0, "lr"), "x"), r"param_groups\[0\] lr must be"),
    "no betas": (_pop(("param_groups", 0, "betas")), r"param_groups\[0\] has no 'betas'"),
    "a parameter's state a string": (_set(("state", 0), "x"), r"state of parameter 0 is a str"),
    "exp_avg of another shape": (_set(("state", 0, "exp_avg"), torch.zeros(7)),
                                 r"exp_avg of parameter 0 is \(7,\)"),
    "step a string": (_set(("state", 0, "step"), "3"), r"step of parameter 0 must be a count"),
}

KFAC: dict[str, tuple[Corrupt, str]] = {
    "preconditioner steps '5'": (_set(("kaisa", "preconditioner", "steps"), "5"),
                                 "preconditioner steps must be an integer >= 0, got '5'"),
    "steps 5.0": (_set(("kaisa", "steps"), 5.0), "steps must be an integer >= 0, got 5.0"),
    "no damping": (_pop(("kaisa", "damping")), "damping must be a finite number"),
    "preconditioner a list": (_set(("kaisa", "preconditioner"), []), "no 'kaisa' entry"),
    "an unknown entry": (_set(("kaisa", "bogus"), 1), r"unexpected entries \['bogus'\]"),
    "an unknown preconditioner entry": (_set(("kaisa", "preconditioner", "bogus"), 1),
                                        r"unexpected entries \['bogus'\]"),
    "lr a string": (_set(("param_groups", 0, "lr"), "x"), r"param_groups\[0\] lr must be"),
    "a parameter's state a string": (_set(("state", 0), "x"), r"state of parameter 0 is a str"),
    "velocity of another shape": (_set(("state", 0, "velocity"), torch.zeros(2, 2)),
                                  r"velocity of parameter 0 is \(2, 2\)"),
    "velocity of integers": (_retype(("state", 0, "velocity"), torch.Tensor.long),
                             r"velocity of parameter 0 must be a floating-point tensor"),
}


def _refused(build: Callable[[int], Any], corrupt: Corrupt, message: str) -> None:
    saved = copy.deepcopy(build(2).state_dict())
    corrupt(saved)
    target = build(1)  # a state of its own, which a partial load would change
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    assert _same(target.state_dict(), before)


@pytest.mark.parametrize("case", PRECONDITIONER)
def test_preconditioner_checks_every_field_first(case: str) -> None:
    _refused(_preconditioner, *PRECONDITIONER[case])


@pytest.mark.parametrize("case", EKFAC)
def test_ekfac_checks_every_field_first(case: str) -> None:
    _refused(_ekfac, *EKFAC[case])


@pytest.mark.parametrize("case", KFAC)
def test_kfac_checks_every_field_first(case: str) -> None:
    _refused(_kfac, *KFAC[case])


@pytest.mark.parametrize("build", [_preconditioner, _ekfac, _kfac])
def test_an_untouched_state_still_loads(build: Callable[[int], Any]) -> None:
    saved = copy.deepcopy(build(2).state_dict())
    target = build(1)
    target.load_state_dict(saved)
    assert _same(target.state_dict(), saved)
