"""``kaisa.EKFAC(adam_graft=d)``: each block part's update scaled to Adam's update norm."""

import copy

import pytest
import torch
from torch import nn

import kaisa


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad()
    (model(x) - x[:, :3]).square().sum().backward()


@pytest.mark.parametrize("decay", [0.0, 0.8])
def test_adam_graft_scales_ekfacs_update_by_the_running_norm_ratio(decay: float) -> None:
    """Against twins synced to the grafted model each step: plain EKFAC (the same factors and
    moments, so the same ``u``) and ``torch.optim.Adam`` (the shadow's update)."""
    grafted_model = _model()
    plain_model, adam_model = copy.deepcopy(grafted_model), copy.deepcopy(grafted_model)
    lr = 0.01
    grafted = kaisa.EKFAC(grafted_model, lr=lr, weight_decay=0.0, adam_graft=decay)
    plain = kaisa.EKFAC(plain_model, lr=lr, weight_decay=0.0)
    adam = torch.optim.Adam(adam_model.parameters(), lr=lr)
    ratio = [0.0] * 4
    torch.manual_seed(1)
    for t in range(1, 6):
        x = torch.randn(16, 6, dtype=torch.float64)
        for twin in (plain_model, adam_model):
            twin.load_state_dict(grafted_model.state_dict())
        before = [p.detach().clone() for p in grafted_model.parameters()]
        for model, opt in ((grafted_model, grafted), (plain_model, plain), (adam_model, adam)):
            _backward(model, x)
            opt.step()
        for i, (p, u, a, p0) in enumerate(zip(grafted_model.parameters(),
                                               plain_model.parameters(),
                                               adam_model.parameters(), before, strict=True)):
            step, plain_step, adam_step = p.detach() - p0, u.detach() - p0, a.detach() - p0
            ratio[i] = decay * ratio[i] + (1 - decay) * float(adam_step.norm() / plain_step.norm())
            scale = ratio[i] / (1 - decay**t)
            torch.testing.assert_close(step, scale * plain_step, rtol=1e-10, atol=1e-14)
            if decay == 0.0:
                torch.testing.assert_close(step.norm(), adam_step.norm(), rtol=1e-10, atol=0)
            if p.ndim == 2 and t > 1:  # EKFAC's direction, not Adam's
                cosine = float((step * adam_step).sum() / (step.norm() * adam_step.norm()))
                assert cosine < 0.9999
            assert abs(scale - 1.0) > 1e-3  # the scale is not the identity


def test_adam_graft_state_resumes_bit_exact() -> None:
    model = _model()
    opt = kaisa.EKFAC(model, lr=0.01, adam_graft=0.9)
    torch.manual_seed(2)
    xs = [torch.randn(16, 6, dtype=torch.float64) for _ in range(4)]
    for x in xs[:2]:
        _backward(model, x)
        opt.step()
    assert {"graft_exp_avg", "graft_exp_avg_sq", "graft_ratio"} <= set(
        opt.state[next(model.parameters())])
    resumed_model = copy.deepcopy(model)
    resumed = kaisa.EKFAC(resumed_model, lr=0.01, adam_graft=0.9)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for x in xs[2:]:
        for m, o in ((model, opt), (resumed_model, resumed)):
            _backward(m, x)
            o.step()
    for p, q in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("value", [1.0, -0.1, True, "0.9"])
def test_adam_graft_rejects_values_outside_0_1(value: object) -> None:
    with pytest.raises(ValueError, match="adam_graft"):
        kaisa.EKFAC(_model(), adam_graft=value)  # type: ignore[arg-type]
