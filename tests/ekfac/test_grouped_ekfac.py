"""EKFAC with blocks of one shape stacked (kaisa.core.grouped): the per-block path's numbers.

Float64, to 1e-12 (a batched product may round like the per-block ones or not): repeated
shapes, a first step that creates the moments in the stacks, basis refreshes that rotate
them, param groups whose Adam scalars or weight decay differ within a shape (those blocks
take the per-block path), and a bit-exact resume from a state saved mid-run.
"""

from __future__ import annotations

import collections
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.grouped import GroupedDirections
from tests.support.calls import Calls


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 10)]
    for _ in range(3):
        layers += [nn.Tanh(), nn.Linear(10, 10)]
    layers += [nn.Tanh(), nn.Linear(10, 10, bias=False), nn.Tanh(),
               nn.Linear(10, 10, bias=False), nn.Tanh(), nn.Linear(10, 4)]
    return nn.Sequential(*layers).double()


def _per_block(opt: kaisa.EKFAC) -> None:
    core = opt.curvature
    core.transform_grouped = (  # type: ignore[method-assign]
        lambda rule, group_rule, uniform=None: GroupedDirections([], core.transform(rule)))


def _run(grouped: bool, steps: int = 9, groups: str = "one",
         **kwargs: Any) -> tuple[list[torch.Tensor], kaisa.EKFAC, nn.Module]:
    model = _model()
    param_groups = None
    if groups == "split":  # weight decay differs within the 10x11 shape group
        ps = list(model.named_parameters())
        param_groups = [
            {"params": [p for n, p in ps if n.startswith("2.")], "weight_decay": 0.5},
            {"params": [p for n, p in ps if not n.startswith("2.")]}]
    opt = kaisa.EKFAC(model, lr=0.01, weight_decay=0.1, basis_update_steps=3,
                      param_groups=param_groups, **kwargs)
    if not grouped:
        _per_block(opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        F.mse_loss(model(x), x[:, :4]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt, model


@pytest.mark.parametrize("groups", ["one", "split"])
def test_grouped_ekfac_equals_the_per_block_path(groups: str) -> None:
    got, opt, _ = _run(True, groups=groups)
    want, _, _ = _run(False, groups=groups)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    moments = [opt.curvature.blocks[n].decomposition["exp_avg"] for n in ("2", "4", "6")]
    # one stack; a group whose weight decay differs takes the per-block path whole
    assert len({m.untyped_storage().data_ptr() for m in moments}) == (
        1 if groups == "one" else 3)


def test_grouped_ekfac_resumes_bit_for_bit() -> None:
    _, opt, model = _run(True, steps=4)
    buffer = io.BytesIO()  # as a checkpoint: no tensor shared with the running optimizer
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    twin_model = _model()
    twin_model.load_state_dict(weights)
    twin = kaisa.EKFAC(twin_model, lr=0.01, weight_decay=0.1, basis_update_steps=3)
    twin.load_state_dict(state)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        for o, m in ((opt, model), (twin, twin_model)):
            o.zero_grad()
            F.mse_loss(m(x), x[:, :4]).backward()
            o.step()
    for a, b in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(a, b)




def test_a_steady_ekfac_steps_calls_do_not_grow_with_the_blocks_of_a_shape() -> None:
    def calls(layers: int) -> collections.Counter[str]:
        torch.manual_seed(0)
        mods: list[nn.Module] = []
        for _ in range(layers):
            mods += [nn.Linear(8, 8), nn.Tanh()]
        model = nn.Sequential(*mods)
        opt = kaisa.EKFAC(model, lr=1e-3)
        x = torch.randn(5, 8)
        for _ in range(3):  # bases, then moments created, then a steady step
            opt.zero_grad()
            model(x).square().sum().backward()
            counter = Calls()
            with counter:
                opt.step()
        return counter.calls

    few, many = calls(3), calls(9)
    per_factor = ("aten.where", "aten.unbind")  # the fold's choice per factor
    assert {k: v for k, v in few.items() if k not in per_factor} == {
        k: v for k, v in many.items() if k not in per_factor}
    assert "aten._local_scalar_dense" not in many  # no read of a device tensor
