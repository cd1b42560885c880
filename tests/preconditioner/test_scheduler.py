"""kaisa.preconditioner.scheduler.LambdaParamScheduler behaves like kfac-pytorch's."""

from __future__ import annotations

import pytest
from torch import nn

import kaisa
from kaisa.preconditioner.scheduler import LambdaParamScheduler


def test_lambdas_multiply_the_current_values_at_the_preconditioner_step() -> None:
    pre = kaisa.KFACPreconditioner(nn.Linear(3, 2), damping=0.1, inv_update_steps=10, lr=0.5)
    sched = LambdaParamScheduler(
        pre, damping_lambda=lambda s: 0.5, inv_update_steps_lambda=lambda s: 1.5,
        lr_lambda=lambda s: 2.0 if s == 0 else 1.0,
    )
    sched.step()
    assert pre.damping == pytest.approx(0.05) and pre.inv_update_steps == 15
    assert pre.lr == pytest.approx(1.0)
    sched.step(step=3)
    assert pre.damping == pytest.approx(0.025) and pre.inv_update_steps == 22  # int(22.5)
    assert pre.lr == pytest.approx(1.0)
    assert pre.state_dict()["damping"] == pytest.approx(0.025)  # checkpoints keep it


def test_callable_hyperparameters_cannot_also_be_scheduled() -> None:
    pre = kaisa.KFACPreconditioner(nn.Linear(3, 2), damping=lambda s: 0.1, kl_clip=None)
    with pytest.raises(ValueError, match="damping is already a callable"):
        LambdaParamScheduler(pre, damping_lambda=lambda s: 0.5)
    with pytest.raises(ValueError, match="kl_clip"):
        LambdaParamScheduler(pre, kl_clip_lambda=lambda s: 0.5)


def test_scheduled_values_are_validated() -> None:
    pre = kaisa.KFACPreconditioner(nn.Linear(3, 2), factor_decay=0.9)
    sched = LambdaParamScheduler(pre, factor_decay_lambda=lambda s: 2.0)
    with pytest.raises(ValueError, match="factor_decay"):
        sched.step()  # 1.8 is not a decay in (0, 1]
    assert pre.factor_decay == pytest.approx(0.9)
