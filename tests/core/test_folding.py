"""Statistics folded into the running factors where they are computed.

``docs/conventions.md``, "Folding statistics where they are computed": each micro-batch's
factor is folded in the backward pass (``F <- rho F`` once a step, with the first finite
one, then ``F <- F + (1 - rho) / k * F_mb``) and the running factors are averaged over
ranks. Checked here on one process against the batch path (the factors summed over the
step, then folded in ``step()``, as blocks that cannot fold still do), for the three
products in float64 to 1e-12; its non-finite rule, ``discard_step()``, statistics computed
in ``step()`` and the memory it holds after a backward pass. The same comparison on 2 and 4
gloo ranks, every strategy: ``tests/distributed/test_folding_distributed.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.folding import FactorFolding

STEPS = 5


@contextlib.contextmanager
def batch_path() -> Iterator[None]:
    """Every block keeps its batch factors until ``step()`` (no folding)."""
    arm = FactorFolding.arm

    def no_fold(self: FactorFolding, blocks: Any, decay: float | None, **kwargs: Any) -> None:
        arm(self, blocks, None, **kwargs)

    FactorFolding.arm = no_fold  # type: ignore[method-assign]
    try:
        yield
    finally:
        FactorFolding.arm = arm  # type: ignore[method-assign]


def net(norm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, groups=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(4 * 2 * 2, 6), nn.LayerNorm(6) if norm else nn.Identity(),
        nn.Tanh(), nn.Linear(6, 3),
    ).double()


def loss_of(product: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy; for EKFAC a squared error, whose G factors have no null vector.

    EKFAC divides each eigenbasis coordinate by its own second moment: along an exact
    null vector of a factor (cross-entropy's output gradients sum to zero; a LayerNorm's
    input gradients too) both are rounding noise, and their ratio follows the rounding.
    """
    if product == "ekfac":
        return F.mse_loss(out, F.one_hot(y, 3).to(out.dtype))
    return F.cross_entropy(out, y)


def data(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    # more rows than any factor's dimension: no degenerate eigenspace (EKFAC's basis
    # within one is arbitrary, so rounding could turn it)
    return (torch.randn(24, 2, 4, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (24,), generator=g))


def run(product: str, *, accumulation: int = 1, in_hook: bool = True,
        ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """``STEPS`` steps of ``product``; the parameters and the core's running factors."""
    model = net(norm=product != "ekfac")
    k = accumulation
    if product == "ekfac":
        opt: Any = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=2, accumulation_steps=k,
                               update_factors_in_hook=in_hook, inv_dtype=torch.float64)
        step: Callable[[], None] = opt.step
        core = opt.curvature
    elif product == "kfac":
        opt = kaisa.KFAC(model, loss="cross_entropy", curvature="empirical", lr=0.1,
                         momentum=0.5, damping=0.01, inv_update_steps=2,
                         inv_dtype=torch.float64, update_factors_in_hook=in_hook)
        core = opt.curvature
    else:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        pre = kaisa.KFACPreconditioner(model, inv_update_steps=2, damping=0.01,
                                       accumulation_steps=k, update_factors_in_hook=in_hook,
                                       inv_dtype=torch.float64)

        def step() -> None:
            pre.step()
            sgd.step()
        core = pre._curvature
    for s in range(STEPS):
        if product == "kfac":
            x, y = data(s, 0)
            opt.step(lambda x=x, y=y: (model(x), y))
            continue
        for p in model.parameters():
            p.grad = None
        for m in range(k):
            x, y = data(s, m)
            (loss_of(product, model(x), y) / k).backward()
        step()
    factors = {n: (b.a, b.g, b.factors.skipped) for n, b in core.blocks.items()}
    return [p.detach().clone() for p in model.parameters()], factors


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float = 1e-12) -> None:
    for x, y in zip(a, b, strict=True):
        scale = max(float(y.abs().max()), 1e-300)
        assert float((x - y).abs().max()) <= rtol * scale, float((x - y).abs().max()) / scale


@pytest.mark.parametrize(("product", "accumulation", "in_hook"), [
    ("preconditioner", 1, True), ("preconditioner", 3, True), ("preconditioner", 2, False),
    ("kfac", 1, True), ("kfac", 1, False), ("ekfac", 1, True), ("ekfac", 2, True),
])
def test_folding_equals_the_batch_path_in_float64(product: str, accumulation: int,
                                                  in_hook: bool) -> None:
    params, factors = run(product, accumulation=accumulation, in_hook=in_hook)
    with batch_path():
        ref_params, ref_factors = run(product, accumulation=accumulation, in_hook=in_hook)
    assert_close(params, ref_params)
    for name, (a, g, skipped) in factors.items():
        ra, rg, rskipped = ref_factors[name]
        assert skipped == rskipped == 0
        for got, want in ((a, ra), (g, rg)):
            assert (got is None) == (want is None), name
            if got is not None:
                assert_close([got], [want])


def _one_layer(k: int) -> tuple[nn.Module, kaisa.KFACPreconditioner]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    return model, kaisa.KFACPreconditioner(model, accumulation_steps=k, factor_decay=0.9,
                                           inv_dtype=torch.float64)


def _backward(model: nn.Module, x: torch.Tensor, scale: float = 1.0) -> None:
    (model(x).square().sum() * scale).backward()


@pytest.mark.parametrize("k", [1, 2])
def test_a_non_finite_micro_batch_is_skipped_and_rho_waits_for_a_finite_one(k: int) -> None:
    """G of a micro-batch whose output gradient overflows is skipped and counted; the
    step's ``rho`` scaling comes with its first finite micro-batch factor."""
    model, pre = _one_layer(k)
    x = torch.randn(4, 3, dtype=torch.float64)
    _backward(model, x)
    if k == 2:
        _backward(model, x)
    pre.step()
    block = next(iter(pre._curvature.blocks.values()))
    g_before = block.factors.g.clone()
    a_before = block.factors.a.clone()
    y = torch.randn(4, 3, dtype=torch.float64)
    _backward(model, y, scale=float("inf"))  # the first micro-batch's G: not finite
    if k == 2:
        _backward(model, y)
    pre.step()
    assert pre.skipped_factor_updates == 1
    a_batch = torch.cat([y, torch.ones(4, 1, dtype=torch.float64)], 1)
    a_batch = a_batch.T @ a_batch / 4
    # A: every micro-batch finite; G: the second micro-batch only (k = 2), none (k = 1)
    torch.testing.assert_close(block.factors.a[0], 0.9 * a_before[0] + 0.1 * a_batch,
                               rtol=1e-12, atol=0)
    if k == 1:
        assert torch.equal(block.factors.g, g_before)
    else:
        d = 2 * model(y).detach()
        g_batch = d.T @ d / 4
        torch.testing.assert_close(block.factors.g[0], 0.9 * g_before[0] + 0.05 * g_batch,
                                   rtol=1e-12, atol=0)


def test_discard_step_after_the_forward_pass_changes_no_factor() -> None:
    model, pre = _one_layer(1)
    x = torch.randn(4, 3, dtype=torch.float64)
    _backward(model, x)
    pre.step()
    model(x)  # abandoned after its forward pass
    pre.discard_step()
    _backward(model, x)
    pre.step()
    # the same as a step that never saw the abandoned forward pass
    model2, pre2 = _one_layer(1)
    _backward(model2, x)
    pre2.step()
    _backward(model2, x)
    pre2.step()
    for n, b in pre._curvature.blocks.items():
        b2 = pre2._curvature.blocks[n]
        assert torch.equal(b.factors.a, b2.factors.a) and torch.equal(b.factors.g, b2.factors.g)


def test_no_batch_factor_is_held_after_the_backward_pass() -> None:
    """The step's statistics are in the running factors before ``step()`` (one process)."""
    model = net()
    pre = kaisa.KFACPreconditioner(model)
    for _ in range(2):
        x, y = data(0, 0)
        F.cross_entropy(model(x), y).backward()
        usage = pre.memory_usage()
        assert usage["buffers"] == 0, usage
        assert all(not b.stats.saved_inputs and not b.stats.has_factors
                   for b in pre._curvature.blocks.values())
        pre.step()
