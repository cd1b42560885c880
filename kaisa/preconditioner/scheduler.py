"""kfac-pytorch's ``kfac.scheduler.LambdaParamScheduler``, for a one-line switch.

``from kfac.scheduler import LambdaParamScheduler`` becomes
``from kaisa.preconditioner.scheduler import LambdaParamScheduler``; arguments and behaviour are the
same: every :meth:`LambdaParamScheduler.step` multiplies each scheduled hyperparameter by
its lambda evaluated at the preconditioner's step count (integers are truncated after the
multiplication, as kfac-pytorch does).
"""

from __future__ import annotations

from collections.abc import Callable

from kaisa.preconditioner.preconditioner import KFACPreconditioner

__all__ = ["LambdaParamScheduler"]

_INTEGER = ("factor_update_steps", "inv_update_steps")


class LambdaParamScheduler:
    """Multiplies preconditioner hyperparameters by lambdas of the step.

    Args:
        preconditioner: The preconditioner whose hyperparameters change.
        factor_update_steps_lambda: Multiplicative factor of ``factor_update_steps``
            (the product is cast to int).
        inv_update_steps_lambda: Multiplicative factor of ``inv_update_steps`` (cast to
            int).
        damping_lambda: Multiplicative factor of ``damping``.
        factor_decay_lambda: Multiplicative factor of ``factor_decay``.
        kl_clip_lambda: Multiplicative factor of ``kl_clip``.
        lr_lambda: Multiplicative factor of ``lr``.

    Raises:
        ValueError: If a lambda is given for a hyperparameter that is already a callable
            (or ``kl_clip=None``).
    """

    def __init__(
        self,
        preconditioner: KFACPreconditioner,
        *,
        factor_update_steps_lambda: Callable[[int], float] | None = None,
        inv_update_steps_lambda: Callable[[int], float] | None = None,
        damping_lambda: Callable[[int], float] | None = None,
        factor_decay_lambda: Callable[[int], float] | None = None,
        kl_clip_lambda: Callable[[int], float] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
    ) -> None:
        self._preconditioner = preconditioner
        lambdas = {
            "factor_update_steps": factor_update_steps_lambda,
            "inv_update_steps": inv_update_steps_lambda,
            "damping": damping_lambda,
            "factor_decay": factor_decay_lambda,
            "kl_clip": kl_clip_lambda,
            "lr": lr_lambda,
        }
        self._lambdas = {name: fn for name, fn in lambdas.items() if fn is not None}
        for name in self._lambdas:
            value = preconditioner.schedule(name)
            if callable(value) or value is None:
                raise ValueError(
                    f"preconditioner.{name} is already a callable (or None) and cannot be "
                    "updated by the LambdaParamScheduler"
                )

    def step(self, step: int | None = None) -> None:
        """Updates the hyperparameters; call after ``preconditioner.step()``.

        Args:
            step: The step passed to the lambdas (default: ``preconditioner.steps``).
        """
        at = self._preconditioner.steps if step is None else step
        for name, fn in self._lambdas.items():
            value = self._preconditioner.schedule(name) * fn(at)
            self._preconditioner.set_schedule(name, int(value) if name in _INTEGER else value)
