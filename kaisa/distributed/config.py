"""How K-FAC runs over ranks: :class:`DistributedConfig` (public) and the engine's bundle.

:class:`DistributedConfig` holds KAISA's strategy and the communication settings; every
product takes one as ``distributed=`` (``kaisa.KFACPreconditioner`` also takes its fields
as keywords, kfac-pytorch's names). :meth:`kaisa.core.config.KFACConfig.engine_config`
validates it and adds what the engine needs besides (:class:`EngineConfig`: the dtypes and
the placement report's log level).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kaisa.distributed.memory import FractionCost
from kaisa.utils.enums import AssignmentStrategy, DistributedStrategy

__all__ = ["DistributedConfig", "EngineConfig"]


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """KAISA's strategy and the communication settings of a product.

    Give it as ``distributed=DistributedConfig(...)`` to
    :class:`~kaisa.KFACPreconditioner`, :class:`~kaisa.EKFAC` or :class:`~kaisa.KFAC`
    (which validate it: a ``ValueError`` names the bad field). ``docs/distributed.md``
    describes each setting.

    Attributes:
        grad_worker_fraction: A :class:`DistributedStrategy` (``COMM_OPT``, ``MEM_OPT``,
            ``HYBRID_OPT``), a float in ``(0, 1]`` or ``'auto'``.
        memory_budget_mb: The per-rank budget of ``'auto'`` (and only of it).
        assignment_strategy: Cost model for placing decompositions.
        colocate_factors: Whether the A and G decompositions of a block share a rank.
        symmetry_aware: Whether symmetric matrices are sent as upper triangles.
        allreduce_bucket_cap_mb: Fusion bucket capacity of the communicator.
        collective_timeout: Seconds a K-FAC collective may wait, ``None`` for the
            process group's timeout.
        cost_model: The time objective of ``'auto'`` (a model with a compute profile,
            such as :class:`kaisa.plan.FractionObjective`): ``'auto'`` then takes the
            fraction it predicts fastest among those that fit ``memory_budget_mb`` (every
            fraction when that is ``None``). ``None``: the memory rule of
            :func:`~kaisa.distributed.choose_fraction`.
    """

    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT
    memory_budget_mb: float | None = None
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    symmetry_aware: bool = False
    allreduce_bucket_cap_mb: float = 25.0
    collective_timeout: float | None = None
    cost_model: FractionCost | None = None


@dataclass(frozen=True, kw_only=True)
class EngineConfig(DistributedConfig):
    """What :class:`~kaisa.distributed.DistributedEngine` is given: validated settings.

    Attributes:
        factor_dtype: The factors' dtype (resolved, for the memory model).
        inv_dtype: The decompositions' dtype (payloads are sent in it).
        loglevel: Logging level of the placement report.
        packed_factors: Running factors kept as upper triangles (for the memory model).
    """

    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    loglevel: int = logging.DEBUG
    packed_factors: bool = False
