"""Blocks of one shape preconditioned as one batch (kaisa.core.grouped): exact and launch-light.

The grouped step must give the per-block path's results (float64, to 1e-12: only the KL
clip's sums are ordered differently), whatever the layouts (grouped convolutions, biases,
singletons, shared parameters) and when a block's direction is not finite; its operator
calls must not grow with the number of blocks of a shape; it must not synchronise.
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


class _Net(nn.Module):
    """Repeated shapes (three 3x3 convs, two grouped convs, two biased Linears) and singletons."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.convs = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1, bias=False) for _ in range(3))
        self.grouped = nn.ModuleList(nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
                                     for _ in range(2))
        self.fcs = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.fc_in = nn.Linear(8 * 4, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        for conv in [*self.convs, *self.grouped]:
            x = torch.tanh(conv(x))
        x = F.adaptive_avg_pool2d(x, 2).flatten(1)
        x = torch.tanh(self.fc_in(x))
        for fc in self.fcs:
            x = torch.tanh(fc(x))
        return self.head(x)


def _per_block(pre: kaisa.KFACPreconditioner) -> kaisa.KFACPreconditioner:
    """``pre`` made to take the per-block path (the reference)."""
    core = pre.curvature
    core.precondition_grouped = (  # type: ignore[method-assign]
        lambda damping: GroupedDirections([], core.precondition(damping)))
    return pre


def _run(grouped: bool, steps: int = 7, *, inject: bool = False, channels_last: bool = False,
         **kwargs: Any) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Net().double()
    if channels_last:  # the conv weights and their gradients in channels-last layout
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=3,
                                   damping=0.01, **kwargs)
    if not grouped:
        _per_block(pre)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        y = torch.randint(0, 5, (6,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if inject and step == 4:  # one block of a group gets a non-finite direction
            block = pre.layers["convs.1"]
            block.decomposition[next(iter(block.decomposition))][0, 0, 0] = float("nan")
        pre.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [
    {},
    {"kl_clip": None},
    {"compute_eigenvalue_outer_product": False},
    {"compute_method": "inverse"},
    {"compute_method": "inverse", "kl_clip": None},
    {"channels_last": True},
])
def test_grouped_step_equals_the_per_block_path(kwargs: dict[str, Any]) -> None:
    for got, want in zip(_run(True, **kwargs), _run(False, **kwargs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kl_clip", [0.001, None])
def test_a_non_finite_direction_keeps_its_blocks_gradient(kl_clip: float | None) -> None:
    got, want = _run(True, inject=True, kl_clip=kl_clip), _run(False, inject=True,
                                                               kl_clip=kl_clip)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    assert all(torch.isfinite(g).all() for g in got)


def test_blocks_sharing_a_parameter_are_written_in_model_order() -> None:
    def run(grouped: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        a, b = nn.Linear(6, 6), nn.Linear(6, 6)
        b.weight = a.weight  # two blocks cover one weight: the later block's write wins
        model = nn.Sequential(a, nn.Tanh(), b).double()
        pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
        if not grouped:
            _per_block(pre)
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(5, 6, dtype=torch.float64)).square().sum().backward()
            pre.step()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    torch.manual_seed(3)
    got = run(True)
    torch.manual_seed(3)
    for g, w in zip(got, run(False), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)




def _plain_step_calls(layers: int, width: int = 12) -> collections.Counter[str]:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width, bias=False), nn.Tanh()]
    model = nn.Sequential(*mods)
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=10, inv_update_steps=100)
    x = torch.randn(4, width)
    for _ in range(2):  # the first step decomposes; the second is a plain one
        model.zero_grad()
        model(x).square().sum().backward()
        counter = Calls()
        with counter:
            pre.step()
    return counter.calls


def test_a_plain_steps_calls_do_not_grow_with_the_blocks_of_a_shape() -> None:
    few, many = _plain_step_calls(3), _plain_step_calls(12)
    assert few == many
    assert few["kaisa.eigen_precondition"] == 1  # one batched call for the whole group
    assert sum(few.values()) <= 25, few


def test_a_plain_step_does_not_synchronise() -> None:
    calls = _plain_step_calls(4)
    assert not {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero"} & calls.keys()


def test_decompositions_are_views_of_one_stack_and_resume_exactly() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2)
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (6,))

    def step(p: kaisa.KFACPreconditioner, m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
        p.step()
        return [q.grad.clone() for q in m.parameters()]  # type: ignore[union-attr]

    before = pre.memory_usage()["decompositions"]
    for _ in range(2):
        step(pre, model)
    convs = [pre.layers[f"convs.{i}"].decomposition["qa"] for i in range(3)]
    assert len({t.untyped_storage().data_ptr() for t in convs}) == 1  # one stack
    assert before == 0 or pre.memory_usage()["decompositions"] == before
    buffer = io.BytesIO()
    torch.save(pre.state_dict(), buffer)
    buffer.seek(0)
    twin_model = _Net().double()
    twin_model.load_state_dict(model.state_dict())
    twin = kaisa.KFACPreconditioner(twin_model, factor_update_steps=1, inv_update_steps=2)
    twin.load_state_dict(torch.load(buffer, weights_only=True))
    for got, want in zip(step(twin, twin_model), step(pre, model), strict=True):
        assert torch.equal(got, want)


def _kfac(grouped: bool, **kwargs: Any) -> tuple[list[torch.Tensor], int]:
    """``kaisa.KFAC``'s parameters after 5 steps, and the calls of the preconditioning op
    (and batched products) in its last step."""
    torch.manual_seed(0)
    model = _Net().double()
    opt = kaisa.KFAC(model, loss="cross_entropy", damping=0.01, inv_update_steps=3, **kwargs)
    core = opt.curvature
    if not grouped:
        core.precondition_grouped = (  # type: ignore[method-assign]
            lambda damping, grads=None: GroupedDirections([], core.precondition(damping, grads)))
    gen = torch.Generator().manual_seed(1)
    calls = Calls()
    for step in range(5):
        x = torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 5, (6,), generator=gen)
        opt.zero_grad()

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> tuple[torch.Tensor, torch.Tensor]:
            return model(x), y

        if kwargs.get("lr", "adaptive") == "adaptive":
            if step == 4:
                with calls:
                    opt.step(closure)
            else:
                opt.step(closure)
            continue
        F.cross_entropy(model(x), y).backward()
        if step == 4:
            with calls:
                opt.step()
        else:
            opt.step()
    return [p.detach().clone() for p in model.parameters()], calls.calls[
        "kaisa.eigen_precondition"] + calls.calls["aten.bmm"]


@pytest.mark.parametrize("kwargs", [
    {"curvature": "empirical", "lr": 0.05, "momentum": 0.9},  # fixed: written to .grad
    {},  # adaptive: directions per parameter, the quadratic model
    {"weight_decay": 0.01},  # adaptive, the directions of gradients that are not .grad
])
def test_kfac_stacks_blocks_of_one_shape(kwargs: dict[str, Any]) -> None:
    (grouped, few), (per_block, many) = _kfac(True, **kwargs), _kfac(False, **kwargs)
    for a, b in zip(grouped, per_block, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13)
    assert few < many, (few, many)
