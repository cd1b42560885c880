"""kaisa.KFAC under faults: non-finite gradients, bad closures, frozen parameters, and
the LM rule's forward pass (docs/reliability.md)."""

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

MODES: dict[str, dict[str, Any]] = {
    "adaptive": {},
    "fixed-mc": {"lr": 0.1, "momentum": 0.9},
    "fixed-empirical": {"lr": 0.1, "momentum": 0.9, "curvature": "empirical"},
}


def _mlp(width: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 2))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_gradient_with_a_finite_loss_changes_no_parameter(mode: str) -> None:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", **MODES[mode])
    x, y = _batch()
    opt.step(lambda: (model(x), y))
    before = _params(model)
    bad = x.clone()
    bad[0, 0] = float("inf")  # tanh saturates: a finite loss, NaN weight gradients (inf * 0)
    with pytest.warns(RuntimeWarning, match="non-finite gradient at step 1"):
        loss = opt.step(lambda: (model(bad), y))
    assert loss is not None and torch.isfinite(loss)
    assert opt.last["non_finite_gradient"] == 1.0 and opt.last["lr"] == 0.0
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)
    opt.step(lambda: (model(x), y))  # training goes on, finite
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# --------------------------------------------------------------------------- item 9


def _one_step_factors(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse")
    opt.step(lambda: (model(x), y))
    return [f for block in opt.curvature.blocks.values() for f in (block.a, block.g)]


def _boom(model: nn.Module, x: torch.Tensor) -> Any:
    model(x)
    raise RuntimeError("boom")


BAD_CLOSURES: dict[str, tuple[Callable[[nn.Module, torch.Tensor, torch.Tensor], Any],
                              type[Exception], str]] = {
    "scalar loss": (lambda m, x, y: F.mse_loss(m(x), y), TypeError,
                    r"closure must return \(outputs, targets\).*not the loss; got a Tensor"),
    "3-tuple": (lambda m, x, y: (m(x), y, 0), TypeError, "got a tuple of 3"),
    "swapped": (lambda m, x, y: (y, m(x)), ValueError, "do not require grad"),
    "detached": (lambda m, x, y: (m(x).detach(), y), ValueError, "do not require grad"),
    "wrong targets": (lambda m, x, y: (m(x), y.T), ValueError, r"shape \(2, 6\)"),
    "raises after the forward": (lambda m, x, y: _boom(m, x), RuntimeError, "boom"),
}


@pytest.mark.parametrize("case", BAD_CLOSURES)
def test_failed_closure_says_what_to_return_and_leaks_nothing(case: str) -> None:
    closure, error, message = BAD_CLOSURES[case]
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse")
    x, y = _batch()
    with pytest.raises(error, match=message):
        opt.step(lambda: closure(model, x + 1.0, y))  # another batch: its A would differ
    assert opt.steps == 0
    opt.step(lambda: (model(x), y))
    got = [f for block in opt.curvature.blocks.values() for f in (block.a, block.g)]
    for a, b in zip(got, _one_step_factors(x, y), strict=True):
        assert torch.equal(a, b)


def test_kfac_of_the_parameters_asks_for_the_model() -> None:
    with pytest.raises(ValueError, match=r"model must be a torch.nn.Module \(KFAC\(model"):
        kaisa.KFAC(_mlp().parameters(), loss="mse")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- item 10


@pytest.mark.parametrize("mode", MODES)
def test_parameter_frozen_after_construction_is_skipped(mode: str) -> None:
    model = _mlp()
    opt = kaisa.KFAC(model, loss="mse", **MODES[mode])
    x, y = _batch()
    opt.step(lambda: (model(x), y))
    for frozen in ([model[0].weight], [model[0].weight, model[2].bias]):
        for p in frozen:
            p.requires_grad_(False)
        before = _params(model)
        opt.step(lambda: (model(x), y))
        for p, old in zip(model.parameters(), before, strict=True):
            frozen_now = any(p is q for q in frozen)
            assert torch.equal(p, old) == frozen_now
            assert bool(torch.isfinite(p).all())


# --------------------------------------------------------------------------- item 11


def test_lm_rule_forward_leaves_batchnorm_statistics_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    opt = kaisa.KFAC(model, loss="mse", damping_interval=1)
    x, y = _batch()
    opt.step(lambda: (model(x), y))
    assert "rho" in opt.last  # the LM rule ran
    reference(x)  # the step's own forward pass, once
    for a, b in zip(model[1].buffers(), reference[1].buffers(), strict=True):
        assert torch.equal(a, b)
    for _ in range(4):
        opt.step(lambda: (model(x), y))
    assert int(model[1].num_batches_tracked) == 5


def test_lm_rule_forward_sees_the_steps_dropout_masks_and_draws_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 2))
    masks: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, out: masks.append(out == 0))
    opt = kaisa.KFAC(model, loss="mse", damping_interval=1)
    x, y = _batch()
    torch.manual_seed(5)
    opt.step(lambda: (model(x), y))
    # the step's forward, the replayed J v pass (jvp='forward') and the LM rule's forward
    assert len(masks) == 3 and "rho" in opt.last
    assert all(torch.equal(masks[0], m) for m in masks[1:])  # comparable with the step's
    after_step = torch.get_rng_state()
    torch.manual_seed(5)
    model(x)  # the step's forward alone
    assert torch.equal(after_step, torch.get_rng_state())
