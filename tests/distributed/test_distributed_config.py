"""``kaisa.DistributedConfig``: every product takes the distributed settings as one object.

Each of :class:`kaisa.KFACPreconditioner`, :class:`kaisa.EKFAC` and :class:`kaisa.KFAC`
given ``distributed=DistributedConfig(...)`` builds the configuration it builds from the
same settings as keywords (and trains the same steps); giving both ways, or a
``DistributedConfig`` with a bad field, or something else, is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa import DistributedConfig

pytestmark = pytest.mark.usefixtures("float64")

SETTINGS: dict[str, Any] = {
    "grad_worker_fraction": kaisa.DistributedStrategy.MEM_OPT,
    "assignment_strategy": "memory",
    "colocate_factors": False,
    "symmetry_aware": True,
    "allreduce_bucket_cap_mb": 10.0,
    "collective_timeout": 5.0,
}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def _preconditioner(model: nn.Module, **kw: Any) -> tuple[Any, Any]:
    pre = kaisa.KFACPreconditioner(model, damping=0.01, **kw)
    return pre, pre.config


def _ekfac(model: nn.Module, **kw: Any) -> tuple[Any, Any]:
    opt = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=1, **kw)
    return opt, opt.config


def _kfac(model: nn.Module, **kw: Any) -> tuple[Any, Any]:
    opt = kaisa.KFAC(model, loss="mse", damping_interval=1, **kw)
    return opt, opt.config


BUILDERS: dict[str, Callable[..., tuple[Any, Any]]] = {
    "preconditioner": _preconditioner, "ekfac": _ekfac, "kfac": _kfac}


def _train(name: str, model: nn.Module, product: Any) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        if name == "kfac":
            product.step(lambda: (model(x), y))
            continue
        sgd.zero_grad()
        F.mse_loss(model(x), y).backward()
        product.step()
        if name == "preconditioner":
            sgd.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", BUILDERS)
def test_a_distributed_config_equals_the_keywords(name: str) -> None:
    build = BUILDERS[name]
    model_a, model_b = _mlp(), _mlp()
    by_object, config = build(model_a, distributed=DistributedConfig(**SETTINGS))
    by_keywords, expected = build(model_b, **SETTINGS)
    assert config == expected
    core = config if name == "preconditioner" else config.kfac
    assert core.grad_worker_fraction is kaisa.DistributedStrategy.MEM_OPT
    assert core.assignment_strategy is kaisa.AssignmentStrategy.MEMORY
    resolved = DistributedConfig(**{**SETTINGS,
                                    "assignment_strategy": kaisa.AssignmentStrategy.MEMORY})
    assert core.distributed == resolved == core.distributed_settings()
    for a, b in zip(_train(name, model_a, by_object), _train(name, model_b, by_keywords),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", BUILDERS)
def test_keywords_without_a_config_give_the_resolved_config(name: str) -> None:
    _, config = BUILDERS[name](_mlp(), symmetry_aware=True)
    core = config if name == "preconditioner" else config.kfac
    assert core.distributed is None
    assert core.distributed_settings() == DistributedConfig(symmetry_aware=True)


@pytest.mark.parametrize("name", BUILDERS)
def test_both_ways_at_once_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"not both: \['symmetry_aware'\]"):
        BUILDERS[name](_mlp(), distributed=DistributedConfig(), symmetry_aware=True)


@pytest.mark.parametrize("name", BUILDERS)
def test_a_bad_config_is_refused_naming_the_field(name: str) -> None:
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        BUILDERS[name](_mlp(), distributed=DistributedConfig(grad_worker_fraction=2.0))
    with pytest.raises(ValueError, match="allreduce_bucket_cap_mb"):
        BUILDERS[name](_mlp(), distributed=DistributedConfig(allreduce_bucket_cap_mb=-1.0))
    with pytest.raises(ValueError, match=r"distributed must be a kaisa\.DistributedConfig"):
        BUILDERS[name](_mlp(), distributed={"grad_worker_fraction": 1.0})
