"""The kfac-pytorch-compatible product, :class:`kaisa.KFACPreconditioner`.

The preconditioner (:mod:`kaisa.preconditioner.preconditioner`: kfac-pytorch's
constructor, schedules and properties, when each phase of the core is due, the KL-clipped
write-back into ``.grad``, its state dict) and kfac-pytorch's
:class:`~kaisa.preconditioner.scheduler.LambdaParamScheduler`.
"""

from __future__ import annotations

from kaisa.preconditioner.preconditioner import KFACPreconditioner
from kaisa.preconditioner.scheduler import LambdaParamScheduler

__all__ = ["KFACPreconditioner", "LambdaParamScheduler"]
