"""Running factors folded where computed and averaged over ranks equal the batch path.

On 2 and 4 gloo ranks, every KAISA strategy, the three products in float64: training with
the statistics folded into the running factors in the backward pass (then the running
factors averaged over ranks) ends with the parameters of the batch path (the micro-batch
factors summed, averaged over ranks, then folded in ``step()``) to 1e-12 relative, and
every rank holds the same running factors; so does ``factor_storage='packed'`` (the
factors' triangles averaged). Under FSDP2 the ranks that hold a block's running factors
fold its averaged batch factors as they arrive, in the backward pass, and equal the batch
path too. One process: ``tests/core/test_folding.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kaisa
from tests.core.test_folding import assert_close, batch_path, loss_of
from tests.distributed.test_fsdp import _data as fsdp_data
from tests.distributed.test_fsdp import _full as full_tensor
from tests.distributed.test_fsdp import build_model
from tests.support.dist import run_distributed

STEPS = 4
ROWS = 24  # per rank: more than any factor's dimension


def _net(product: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 4 * 4, 6),
        nn.LayerNorm(6) if product != "ekfac" else nn.Identity(), nn.Tanh(), nn.Linear(6, 3),
    ).double()


def _train(product: str, strategy: str, rank: int, world: int,
           storage: str = "dense") -> list[torch.Tensor]:
    model = _net(product)
    net = DistributedDataParallel(model)
    common: dict[str, Any] = {"grad_worker_fraction": strategy, "inv_dtype": torch.float64,
                              "factor_storage": storage}
    k = 2 if product != "kfac" else 1
    if product == "ekfac":
        opt: Any = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=2, accumulation_steps=k,
                               **common)
    elif product == "kfac":
        opt = kaisa.KFAC(model, loss="cross_entropy", curvature="empirical", lr=0.1,
                         momentum=0.5, damping=0.01, inv_update_steps=2, **common)
    else:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        pre = kaisa.KFACPreconditioner(model, inv_update_steps=2, damping=0.01,
                                       accumulation_steps=k, **common)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(k, world * ROWS, 2, 4, 4, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (k, world * ROWS), generator=g)
        x, y = x[:, rank * ROWS:(rank + 1) * ROWS], y[:, rank * ROWS:(rank + 1) * ROWS]
        if product == "kfac":
            opt.step(lambda x=x[0], y=y[0]: (net(x), y))
            continue
        for p in model.parameters():
            p.grad = None
        for m in range(k):
            (loss_of(product, net(x[m]), y[m]) / k).backward()
        if product == "ekfac":
            opt.step()
        else:
            pre.step()
            sgd.step()
    core = opt.curvature if product != "preconditioner" else pre._curvature
    factors = [t for b in core.blocks.values() for t in (b.a, b.g) if t is not None]
    return [p.detach().clone() for p in model.parameters()] + factors


def _job(rank: int, world: int, cases: list[tuple[str, str]]) -> list[list[list[torch.Tensor]]]:
    out = []
    for product, strategy in cases:
        folded = _train(product, strategy, rank, world)
        with batch_path():
            batched = _train(product, strategy, rank, world)
        packed = _train(product, strategy, rank, world, "packed")
        out.append([folded, batched, packed])
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_folding_equals_the_batch_path_on_every_strategy(world: int) -> None:
    strategies = ["comm_opt", "mem_opt"] + (["hybrid_opt"] if world == 4 else [])
    cases = [(p, s) for p in ("preconditioner", "kfac", "ekfac") for s in strategies]
    results = run_distributed(_job, world, cases, timeout=280)
    for i, case in enumerate(cases):
        folded, batched, packed = results[0][i]
        assert_close(folded, batched)  # parameters and running factors, to 1e-12
        assert_close(packed, folded)  # packed factors: the triangles averaged
        for r in range(1, world):
            for a, b in zip(results[r][i][0], folded, strict=True):
                assert torch.equal(a, b), f"rank {r} differs from rank 0 ({case})"



def _train_fsdp(product: str, rank: int, world: int, *, probe: bool) -> dict[str, Any]:
    """Three steps on a model FSDP2 shards; what each rank holds after each backward pass.

    With ``probe`` the last step's batch factors left for ``step()`` are taken (and lost).
    """
    model = build_model(False, sharded=True, mesh_shape=None)
    if product == "ekfac":
        opt: Any = kaisa.EKFAC(model, lr=1e-2, eps=1e-6, basis_update_steps=2,
                               grad_worker_fraction="mem_opt")
        curvature = opt.curvature
    else:
        pre = kaisa.KFACPreconditioner(model, grad_worker_fraction="mem_opt",
                                       inv_dtype=torch.float64, damping=0.01, lr=0.1,
                                       inv_update_steps=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        curvature = pre.curvature
    held, kept = [], []
    for step in range(STEPS):
        x, y = fsdp_data(world, step, ROWS)
        x, y = (t[rank * ROWS:(rank + 1) * ROWS] for t in (x, y))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        # Before step(): the blocks whose running factors this rank holds.
        held.append(sorted(n for n, b in curvature.blocks.items()
                           if b.g is not None and not b.diagonal))
        if probe and step == STEPS - 1:
            kept.append(sorted(curvature.engine.averaged_factors()))  # what step() would fold
        if product != "ekfac":
            pre.step()
        opt.step()
    values = [full_tensor(p) for p in model.parameters()]
    factors = {n: [t for t in (b.a, b.g) if t is not None] for n, b in curvature.blocks.items()}
    return {"values": values, "factors": factors, "held": held, "kept": kept,
            "owned": sorted(n for n, b in curvature.blocks.items()
                            if not b.diagonal and curvature.engine.holds_factors(n))}


def _fsdp_job(rank: int, world: int, products: list[str]) -> list[list[dict[str, Any]]]:
    out = []
    for product in products:
        folded = _train_fsdp(product, rank, world, probe=False)
        probed = _train_fsdp(product, rank, world, probe=True)
        with batch_path():
            batched = _train_fsdp(product, rank, world, probe=False)
        folded["kept"], folded["probed"] = probed["kept"], probed["factors"]
        out.append([folded, batched])
    return out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_holders_fold_the_averages_as_they_arrive() -> None:
    """Under FSDP2 (MEM-OPT, 2 ranks) each rank holding a block folds its averaged batch
    factors by the end of the backward pass (the batch path only in ``step()``) and keeps
    none for ``step()``; parameters and running factors equal the batch path's to 1e-12."""
    world, products = 2, ["preconditioner", "ekfac"]
    results = run_distributed(_fsdp_job, world, products, timeout=280)
    for i, product in enumerate(products):
        for rank in range(world):
            folded, batched = results[rank][i]
            assert folded["owned"], f"rank {rank} holds no block ({product})"
            # Step 0: the running factors exist before step() only where folded on arrival.
            assert folded["held"][0] == folded["owned"], (product, rank)
            assert batched["held"][0] == [], (product, rank)
            assert folded["kept"] == [[]], (product, rank)
            assert_close(folded["values"], batched["values"])
            assert folded["factors"].keys() == batched["factors"].keys()
            for name, ts in folded["factors"].items():
                assert_close(ts, batched["factors"][name])
                # Taking what step() would fold lost nothing: there was nothing.
                assert all(torch.equal(a, b) for a, b in zip(ts, folded["probed"][name],
                                                             strict=True))
