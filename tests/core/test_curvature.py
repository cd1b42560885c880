"""The curvature core (kaisa.core.curvature.KFACCurvature): explicit phases, no write-back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.config import KFACConfig
from kaisa.core.curvature import KFACCurvature
from tests.support.explicit import kron_solve

pytestmark = pytest.mark.usefixtures("float64")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _recorded(core: KFACCurvature, model: nn.Module) -> None:
    x, y = _data()
    core.recording = True
    F.mse_loss(model(x), y).backward()
    core.update_factors(0.5)


def test_precondition_returns_directions_and_writes_nothing() -> None:
    model = _net()
    core = KFACCurvature(model, KFACConfig(inv_dtype=torch.float64))
    _recorded(core, model)
    core.update_decompositions(0.1)
    grads_before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(2)
    given = {p: torch.randn(p.shape, generator=g) for p in model.parameters()}
    out = core.precondition(0.1, grads=given)
    assert [e.block.name for e in out] == ["0", "2"]
    for entry in out:
        block = entry.block
        weight, bias = block.parameters()
        want = torch.cat([given[weight], given[bias][:, None]], dim=1)
        assert torch.equal(entry.grad[0], want) and entry.valid is None
        assert block.a is not None and block.g is not None
        explicit = kron_solve(block.g[0], block.a[0], want, 0.1)
        torch.testing.assert_close(entry.direction[0], explicit, rtol=1e-9, atol=1e-9)
        parts = block.split(entry.direction)
        assert [t.shape for t in parts] == [weight.shape, bias.shape]
    for p, before in zip(model.parameters(), grads_before, strict=True):
        assert torch.equal(p.grad, before)  # type: ignore[arg-type]


def test_output_gradients_scope_and_recording_flag() -> None:
    model = _net()
    core = KFACCurvature(model, KFACConfig())
    x, y = _data()
    core.recording = False
    F.mse_loss(model(x), y).backward()
    assert all(not b.stats.has_factors for b in core.blocks.values())  # not armed
    core.recording = True
    with core.output_gradients(passes=0):
        F.mse_loss(model(x), y).backward()
    stats = [b.stats for b in core.blocks.values()]
    assert all(s.a_count == 1 and s.g_count == 0 for s in stats)  # A only
    core.discard()
    assert all(not b.stats.has_factors for b in core.blocks.values())
    with core.output_gradients(passes=1, divisor=2.0):
        F.mse_loss(model(x), y).backward()
    core.update_factors(0.0)  # decay 0: the running factors are the batch factors
    core.end_step()
    halved = {n: b.g.clone() for n, b in core.blocks.items()}  # type: ignore[union-attr]
    F.mse_loss(model(x), y).backward()  # outside any scope: the grad scaler's 1
    core.update_factors(0.0)
    for name, block in core.blocks.items():
        assert block.g is not None
        torch.testing.assert_close(halved[name] * 4.0, block.g)  # G of D / s


def test_preconditioner_arms_only_factor_steps() -> None:
    model = _net()
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=2)
    x, y = _data()
    armed = []
    for _ in range(4):
        armed.append(pre.curvature.recording)
        F.mse_loss(model(x), y).backward()
        pre.step()
    assert armed == [True, False, True, False]


def test_config_reflects_set_schedule_and_load_state_dict() -> None:
    pre = kaisa.KFACPreconditioner(_net(), damping=0.01)
    pre.set_schedule("damping", 0.5)
    assert pre.config.damping == 0.5 and pre.damping == 0.5
    other = kaisa.KFACPreconditioner(_net(), damping=0.01)
    other.load_state_dict(pre.state_dict())
    assert other.config.damping == 0.5


def test_kfac_does_not_touch_grad_with_weight_decay() -> None:
    model = _net()
    opt = kaisa.KFAC(model, loss="mse", weight_decay=0.1)
    x, y = _data()
    opt.step(lambda: (model(x), y))
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    raw = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt.step(lambda: (model(x), y))
    for p, before in zip(model.parameters(), raw, strict=True):
        assert torch.equal(p.grad, before)  # type: ignore[arg-type]
