"""Callables of the step are evaluated at the steps that run, in every product.

A schedule valid for every step that runs (``factor_decay = 0.5 + 0.2 s`` over three
steps) never raises; the step that would use an invalid value raises, at that step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def _decay(seen: list[int]) -> Callable[[int], float]:
    def decay(step: int) -> float:
        seen.append(step)
        return 0.5 + 0.2 * step  # 0.5, 0.7, 0.9, then 1.1: out of (0, 1]

    return decay


PRODUCTS: dict[str, Callable[[nn.Module, Callable[[int], float]], Any]] = {
    "KFACPreconditioner": lambda m, d: kaisa.KFACPreconditioner(m, factor_decay=d),
    "KFAC": lambda m, d: kaisa.KFAC(m, loss="cross_entropy", curvature="empirical", lr=0.1,
                                    momentum=0.0, factor_decay=d),
    "EKFAC": lambda m, d: kaisa.EKFAC(m, factor_decay=d),
    "KFACMuon eigen": lambda m, d: kaisa.KFACMuon(m, curvature="eigen", factor_decay=d),
    "KFACMuon input": lambda m, d: kaisa.KFACMuon(m, curvature="input", factor_decay=d),
}


def _step(model: nn.Module, opt: Any, step: int) -> None:
    x, y = _batch(step)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("product", list(PRODUCTS))
def test_a_schedule_is_read_at_the_steps_that_run(product: str) -> None:
    model, seen = _model(), []
    opt = PRODUCTS[product](model, _decay(seen))
    for step in range(3):
        _step(model, opt, step)
    assert set(seen) == {0, 1, 2}, seen  # never step 3's value: step 3 has not run
    state = opt.state_dict()  # saving and loading read nothing ahead either
    opt.load_state_dict(state)
    assert set(seen) == {0, 1, 2}, seen
    with pytest.raises(ValueError, match=r"factor_decay must be in \(0.0, 1.0\], got 1.1"):
        _step(model, opt, 3)  # the step that uses it raises


def test_a_step_whose_forward_ran_elsewhere_still_reads_its_own_value() -> None:
    """The plan is read at the step's first forward pass; an evaluation forward in
    between (no gradient) reads the same step's value."""
    model, seen = _model(), []
    pre = kaisa.KFACPreconditioner(model, factor_decay=_decay(seen))
    _step(model, pre, 0)
    with torch.no_grad():
        model.eval()
        model(_batch(9)[0])
        model.train()
    _step(model, pre, 1)
    assert set(seen) == {0, 1}


def test_an_evaluation_forward_after_the_last_step_reads_no_plan() -> None:
    """Evaluating the model after training (eval mode, or no_grad) reads nothing of the
    step that never runs; a failing plan stays pending and raises again when it is due."""
    model, seen = _model(), []
    pre = kaisa.KFACPreconditioner(model, factor_decay=_decay(seen))
    for step in range(3):
        _step(model, pre, step)
    model.eval()
    model(_batch(9)[0])
    model.train()
    with torch.no_grad():
        model(_batch(9)[0])
    assert set(seen) == {0, 1, 2}
    for _ in range(2):  # the plan raises at the training forward, and again
        with pytest.raises(ValueError, match="factor_decay must be in"):
            _step(model, pre, 3)
