"""kfac-pytorch's ``kfac.scheduler.LambdaParamScheduler``, for a one-line switch.

``from kfac.scheduler import LambdaParamScheduler`` becomes
``from kaisa.scheduler import LambdaParamScheduler``. It lives in
:mod:`kaisa.preconditioner.scheduler`.
"""

from __future__ import annotations

from kaisa.preconditioner.scheduler import LambdaParamScheduler as LambdaParamScheduler
