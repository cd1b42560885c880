"""The iteration model uses the engine's placement, and 'auto' with a cost model minimises it."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from torch import nn

from kaisa.blocks import register_blocks
from kaisa.distributed import DistributedEngine, EngineConfig, WorkerGrid, valid_fractions
from kaisa.methods import make_method
from kaisa.plan import (
    ComputeProfile,
    FractionObjective,
    IterationModel,
    KernelFit,
    PlanConfig,
    parse_network,
    workload_from_module,
)
from kaisa.utils.enums import ComputeMethod
from tests.support.fakes import FakeCommunicator

PROFILE = ComputeProfile(
    device="synthetic", source="test",
    covariance=KernelFit(overhead_s=2e-5, rate=2e12),
    precondition=KernelFit(overhead_s=5e-5, rate=1e12),
    eigh=KernelFit(overhead_s=1e-3, rate=2e9),
)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    widths = [64, 256, 512, 128, 384, 256, 96, 10]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]), torch.randn(32, 64)


def _engine(world: int, config: EngineConfig) -> DistributedEngine:
    model, _ = _model()
    blocks = register_blocks(model)
    return DistributedEngine(blocks, config, make_method(ComputeMethod.EIGEN),
                             communicator=FakeCommunicator(rank=0, world_size=world))


@pytest.mark.parametrize(("world", "fraction"), [(4, Fraction(1)), (8, Fraction(1, 2)),
                                                 (8, Fraction(1, 8)), (16, Fraction(1, 4))])
def test_placement_is_the_engines(world: int, fraction: Fraction) -> None:
    engine = _engine(world, EngineConfig(grad_worker_fraction=float(fraction)))
    model, example = _model()
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=parse_network("a100-ib"))
    cost = plan.cost(WorkerGrid(world, int(fraction * world)))
    assert cost.placement == engine.placement
    assert cost.memory_mb == pytest.approx(
        engine.memory_estimates()[fraction].max_total_mb)


def test_objective_is_the_fraction_dependent_part_of_the_model() -> None:
    model, example = _model()
    net = parse_network("2x10Gb/s@20us")
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=net)
    objective = FractionObjective(compute=PROFILE, network=net, inv_update_steps=10)
    w = plan.workload
    for cost in plan.sweep(8):
        per = cost.iteration(1, 10)
        part = sum(per[p] for p in ("decomposition", "decomposition_comm", "precondition",
                                    "gradient_comm"))
        assert objective(cost.placement, layer_groups=w.layer_groups,
                         diagonal_sides=w.diagonal_sides) == pytest.approx(part)


def test_meta_device_workload_matches_the_real_one() -> None:
    model, example = _model()
    real = workload_from_module(model, example)
    with torch.device("meta"):
        meta_model, _ = _model()
    meta = workload_from_module(meta_model, example.to("meta"))
    assert real == meta
    assert [b.rows for b in real.blocks] == [32] * 7


@pytest.mark.parametrize("network", ["1x1Gb/s@1ms", "1x100Gb/s@5us", "4x600GB/s,1x25Gb/s",
                                     "2x50GB/s@1us,1x1Gb/s@200us"])
@pytest.mark.parametrize("world", [4, 8, 16])
@pytest.mark.parametrize("inv_update_steps", [1, 50])
def test_auto_with_a_cost_model_picks_the_brute_force_fastest(
        network: str, world: int, inv_update_steps: int) -> None:
    net = parse_network(network)
    objective = FractionObjective(compute=PROFILE, network=net, config=PlanConfig(),
                                  inv_update_steps=inv_update_steps)
    engine = _engine(world, EngineConfig(grad_worker_fraction="auto", cost_model=objective))
    model, example = _model()
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=net)
    sweep = plan.sweep(world)
    fastest = min(sweep, key=lambda c: (c.total(1, inv_update_steps), -c.grid.fraction))
    assert engine.grid.fraction == fastest.grid.fraction


def test_auto_with_a_cost_model_respects_the_budget_and_differs_from_the_memory_rule() -> None:
    net = parse_network("1x1Gb/s@1ms")
    model, example = _model()
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=net)
    sweep = plan.sweep(8)
    # inverse every step: the gradient broadcasts are cheaper than more decompositions
    fastest = min(sweep, key=lambda c: (c.total(), -c.grid.fraction))
    assert fastest.grid.fraction != 1  # the memory rule (no budget pressure) would take 1
    memory_rule = _engine(8, EngineConfig(grad_worker_fraction="auto",
                                               memory_budget_mb=1e6))
    assert memory_rule.grid.fraction == 1
    timed = _engine(8, EngineConfig(grad_worker_fraction="auto", memory_budget_mb=1e6,
                                         cost_model=FractionObjective(compute=PROFILE,
                                                                      network=net)))
    assert timed.grid.fraction == fastest.grid.fraction
    # inverse every 50 steps COMM-OPT is fastest; a budget below its memory excludes it
    slow_inverse = FractionObjective(compute=PROFILE, network=net, inv_update_steps=50)
    fastest = min(sweep, key=lambda c: (c.total(1, 50), -c.grid.fraction))
    assert fastest.grid.fraction == 1
    budget = max(c.memory_mb for c in sweep if c.grid.fraction != 1) + 0.01
    fits = [c for c in sweep if c.memory_mb <= budget]
    assert fastest not in fits and fits
    best_fit = min(fits, key=lambda c: (c.total(1, 50), -c.grid.fraction))
    tight = _engine(8, EngineConfig(grad_worker_fraction="auto", memory_budget_mb=budget,
                                         cost_model=slow_inverse))
    assert tight.grid.fraction == best_fit.grid.fraction
    assert set(valid_fractions(8)) == {c.grid.fraction for c in sweep}


def test_the_preconditioner_takes_the_cost_model() -> None:
    from kaisa import KFACPreconditioner
    from kaisa.core.config import KFACConfig

    net = parse_network("1x1Gb/s@1ms")
    objective = FractionObjective(compute=PROFILE, network=net)
    with pytest.raises(ValueError, match="needs memory_budget_mb"):
        KFACConfig(grad_worker_fraction="auto")
    with pytest.raises(ValueError, match="cost_model"):
        KFACConfig(cost_model=objective)  # COMM-OPT: nothing to choose
    with pytest.raises(ValueError, match="cost_model"):
        KFACConfig(grad_worker_fraction="auto", cost_model="fast")
    cfg = KFACConfig(grad_worker_fraction="auto", cost_model=objective)
    assert cfg.settings()["cost_model"] == "FractionObjective"  # ranks agree on its kind
    engine = _engine(8, cfg.engine_config(torch.float32))
    model, example = _model()
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=net)
    fastest = min(plan.sweep(8), key=lambda c: (c.total(), -c.grid.fraction))
    assert engine.grid.fraction == fastest.grid.fraction
    single, _ = _model()
    pre = KFACPreconditioner(single, grad_worker_fraction="auto", cost_model=objective)
    assert pre.config.cost_model is objective
