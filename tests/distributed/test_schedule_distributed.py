"""Spread decompositions with warm-started bases on gloo ranks: every strategy as one process.

``decomposition_spread`` and ``basis_refresh='qr'`` (``docs/conventions.md``, "Spread
decompositions", "Warm-started eigenbases") on 2 and 4 ranks, float64, against one process
on the global batch. A warm start continues from the basis ``eigh`` chose, which is
ill-conditioned where eigenvalues (nearly) repeat: there rounding decides it, and runs that
round differently part. So the model's factors here keep their eigenvalues apart: every
side at most as wide as the rows of a step, outputs as wide as the layers, and a loss
scaled so that the statistics dominate the identity the running factors start from.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from tests.support.dist import run_distributed

STEPS = 7
BATCH_PER_RANK = 4


def _train(strategy: str, colocate: bool, world: int, rank: int | None) -> list[torch.Tensor]:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    # outputs as wide as the layers: no output gradient confined to a narrower subspace
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(),
                          nn.Linear(7, 7))
    sgd = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
    pre = kaisa.KFACPreconditioner(
        model, inv_update_steps=3, decomposition_spread=2, basis_refresh="qr", eigh_every=2,
        damping=0.01, factor_decay=0.5, inv_dtype=torch.float64,
        grad_worker_fraction=strategy,
        colocate_factors=colocate)
    n = max(world, 2) * BATCH_PER_RANK  # >= every side's width - 1
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(n, 6, generator=gen)
        y = torch.randn(n, 7, generator=gen)
        if rank is not None:
            x, y = (t[rank * n // world:(rank + 1) * n // world] for t in (x, y))
        model.zero_grad()
        # the reference's loss times the world, its gradients over it: the factors of a
        # batch of `world` ranks' rows, the mean gradient (as tests/distributed/
        # test_distributed.py)
        (1000.0 * F.mse_loss(model(x), y) * (world if rank is None else 1)).backward()
        for p in model.parameters():
            if rank is not None:
                torch.distributed.all_reduce(p.grad)
            p.grad /= world
        pre.step()
        sgd.step()
    return [p.detach().clone() for p in model.parameters()]


def _job(rank: int, world: int, runs: list[tuple[str, bool]]) -> list[list[torch.Tensor]]:
    return [_train(strategy, colocate, world, rank) for strategy, colocate in runs]


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 4])
def test_spread_warm_started_decompositions_equal_one_process(world: int) -> None:
    """Parts at steps 0 (all), 1, 3, 4 and 6; steps 3 and 4 warm-start from steps 0 and 1."""
    runs = [("comm_opt", True), ("mem_opt", True), ("mem_opt", False)]
    if world > 2:
        runs.append(("hybrid_opt", False))
    results = run_distributed(_job, world, runs, timeout=140)
    old = torch.get_default_dtype()
    try:
        reference = _train("comm_opt", True, world, None)
    finally:
        torch.set_default_dtype(old)
    for i, (strategy, colocate) in enumerate(runs):
        for r in range(world):
            for p0, p in zip(results[0][i], results[r][i], strict=True):
                assert torch.equal(p0, p), f"rank {r} differs ({strategy}, {colocate})"
        for p, q in zip(results[0][i], reference, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10,
                                       msg=f"vs one process ({strategy}, {colocate})")
