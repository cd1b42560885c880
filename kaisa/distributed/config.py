"""What the distributed engine is given: KAISA's strategy and the communication settings.

:meth:`kaisa.core.config.KFACConfig.distributed` builds it from the validated
configuration (and the model's dtype).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kaisa.distributed.memory import FractionCost
from kaisa.utils.enums import AssignmentStrategy, DistributedStrategy

__all__ = ["DistributedConfig"]


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """What :class:`~kaisa.distributed.DistributedEngine` is given.

    KAISA's strategy and the communication settings, already validated by
    :class:`KFACConfig`.

    Attributes:
        grad_worker_fraction: A :class:`DistributedStrategy`, a float or ``'auto'``.
        memory_budget_mb: The budget of ``'auto'``.
        assignment_strategy: Cost model for placing decompositions.
        colocate_factors: Whether the A and G decompositions of a block share a rank.
        symmetry_aware: Whether symmetric matrices are sent as upper triangles.
        allreduce_bucket_cap_mb: Fusion bucket capacity.
        collective_timeout: Seconds a collective may wait, ``None`` for the group's.
        factor_dtype: The factors' dtype (resolved, for the memory model).
        inv_dtype: The decompositions' dtype (payloads are sent in it).
        loglevel: Logging level of the placement report.
        cost_model: The time objective of ``'auto'`` (a model with a compute profile,
            such as :class:`kaisa.plan.FractionObjective`): ``'auto'`` then takes the
            fraction it predicts fastest among those that fit ``memory_budget_mb`` (every
            fraction when that is ``None``). ``None``: the memory rule of
            :func:`~kaisa.distributed.choose_fraction`.
    """

    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT
    memory_budget_mb: float | None = None
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    symmetry_aware: bool = False
    allreduce_bucket_cap_mb: float = 25.0
    collective_timeout: float | None = None
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    loglevel: int = logging.DEBUG
    cost_model: FractionCost | None = None
