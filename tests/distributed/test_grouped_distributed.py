"""Stacked blocks of one shape on gloo ranks: every strategy as the per-block path (float64).

Under COMM-OPT every rank stacks every group; under MEM-OPT and HYBRID-OPT a rank stacks
only the blocks it preconditions and sends to no one, the others go block by block (and
``tests/distributed/test_distributed.py`` checks every strategy against one process). Both
products that stack (``KFACPreconditioner`` + SGD, ``EKFAC``) must give the per-block
path's parameters, the same on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.grouped import GroupedDirections
from tests.support.dist import run_distributed

STEPS = 5
BATCH_PER_RANK = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 8)]
    for _ in range(4):  # a group of four 8 x 9 blocks
        layers += [nn.Tanh(), nn.Linear(8, 8)]
    layers += [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _train(product: str, strategy: str, grouped: bool, world: int,
           rank: int) -> list[torch.Tensor]:
    """Trains on rank ``rank``'s slice of each batch, stacked or block by block."""
    model = _model()
    if product == "ekfac":
        opt: Any = kaisa.EKFAC(model, lr=0.01, weight_decay=0.1, basis_update_steps=2,
                               grad_worker_fraction=strategy)
        step = opt.step
        core = opt.curvature
        if not grouped:
            core.transform_grouped = (  # type: ignore[method-assign]
                lambda rule, group_rule, uniform=None: GroupedDirections(
                    [], core.transform(rule)))
    else:
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        pre = kaisa.KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=2,
                                       damping=0.01, grad_worker_fraction=strategy)
        core = pre.curvature
        if not grouped:
            core.precondition_grouped = (  # type: ignore[method-assign]
                lambda damping: GroupedDirections([], core.precondition(damping)))

        def step() -> None:
            pre.step()
            sgd.step()
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    for i in range(STEPS):
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(world * BATCH_PER_RANK, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(world * BATCH_PER_RANK, 3, generator=gen, dtype=torch.float64)
        model.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        for p in model.parameters():  # data parallel: the mean gradient, as DDP gives it
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        step()
    return [p.detach().clone() for p in model.parameters()]


def _job(rank: int, world: int, configs: list[tuple[str, str, bool]]
         ) -> list[list[torch.Tensor]]:
    torch.set_default_dtype(torch.float64)
    return [_train(*config, world, rank) for config in configs]


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_stacked_blocks_on_every_strategy_equal_the_per_block_path(world: int) -> None:
    strategies = ["comm_opt", "mem_opt"] + (["hybrid_opt"] if world > 2 else [])
    configs = [(p, s, g) for p in ("kfac_pre", "ekfac") for s in strategies
               for g in (True, False)]
    results = run_distributed(_job, world, configs, timeout=230)
    for i, (product, strategy, grouped) in enumerate(configs):
        for r in range(1, world):
            for a, b in zip(results[0][i], results[r][i], strict=True):
                assert torch.equal(a, b), f"rank {r} differs: {product} {strategy} {grouped}"
        if grouped:  # the next entry is the same run block by block
            for got, want in zip(results[0][i], results[0][i + 1], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
