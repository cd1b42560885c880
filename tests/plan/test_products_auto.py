"""Every product takes ``cost_model`` with ``grad_worker_fraction='auto'`` (4 gloo ranks).

The engine each product builds must run the fraction a brute-force sweep of
:class:`kaisa.plan.IterationModel` finds fastest, on a network and profile where that is
not COMM-OPT (the memory rule's choice without a budget).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.plan.test_model import PROFILE, _model
from tests.support.dist import run_distributed

NETWORK, WORLD = "1x1Gb/s@1ms", 4


def _fastest_fraction() -> float:
    from kaisa.plan import IterationModel, parse_network, workload_from_module

    model, example = _model()
    plan = IterationModel(workload=workload_from_module(model, example), compute=PROFILE,
                          network=parse_network(NETWORK))
    fastest = min(plan.sweep(WORLD), key=lambda c: (c.total(), -c.grid.fraction))
    return float(fastest.grid.fraction)


def _auto_job(rank: int, world: int) -> dict[str, Any]:
    import kaisa
    from kaisa.plan import FractionObjective, parse_network

    objective = FractionObjective(compute=PROFILE, network=parse_network(NETWORK))
    chosen = {}
    for name, make in (
        ("KFACPreconditioner", lambda m: kaisa.KFACPreconditioner(
            m, grad_worker_fraction="auto", cost_model=objective)),
        ("KFAC", lambda m: kaisa.KFAC(m, loss="cross_entropy", grad_worker_fraction="auto",
                                      cost_model=objective)),
        ("EKFAC", lambda m: kaisa.EKFAC(m, grad_worker_fraction="auto", cost_model=objective)),
        ("EKFAC memory rule", lambda m: kaisa.EKFAC(m, grad_worker_fraction="auto",
                                                    memory_budget_mb=1e6)),
    ):
        product = make(_model()[0])
        chosen[name] = product.curvature.engine.grid.fraction
    return chosen


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_every_product_runs_the_fraction_the_cost_model_finds_fastest() -> None:
    fastest = _fastest_fraction()
    assert fastest != 1.0  # else the test could not tell the objective from the memory rule
    results = run_distributed(_auto_job, WORLD, timeout=150)
    for chosen in results:
        assert chosen == {"KFACPreconditioner": fastest, "KFAC": fastest, "EKFAC": fastest,
                          "EKFAC memory rule": 1.0}
