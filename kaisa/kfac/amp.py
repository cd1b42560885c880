"""Loss scaling for :class:`kaisa.KFAC`: it drives a ``torch.amp.GradScaler`` itself.

KFAC runs several backward passes per step (Monte-Carlo samples, the true loss), so it
scales each one, unscales the gradients once, skips the update of a step whose gradients
overflowed (the factors of that step are skipped too) and updates the scale at the end
of the step. Do not call ``scaler.step``/``scaler.update`` yourself; without a closure
call ``scaler.scale(loss).backward()`` then ``opt.step()``. Losses and the quadratic model
are computed in float32 from half-precision outputs. :class:`LossScaling` is that
driver; with no scaler (or a disabled one) it scales and unscales nothing, and a
non-finite gradient is then a fault of the batch or the model, not an overflow.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from kaisa.core.hooks import loss_scale
from kaisa.utils.finite import finite_each

__all__ = ["HALF", "LossScaling", "full_precision_outputs"]

#: The half-precision dtypes of autocast outputs.
HALF = (torch.float16, torch.bfloat16)


def full_precision_outputs(outputs: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs (autocast) as float32, for the loss and the quadratic model."""
    return outputs.float() if outputs.dtype in HALF else outputs


class LossScaling:
    """The grad scaler KFAC drives, or none.

    Args:
        scaler: A ``torch.amp.GradScaler`` or ``None``.

    Raises:
        ValueError: If ``scaler`` is not a grad scaler.
    """

    def __init__(self, scaler: Any) -> None:
        if scaler is not None and not all(
            hasattr(scaler, m) for m in ("scale", "unscale_", "update", "get_scale")
        ):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {scaler!r}")
        self.scaler = scaler

    def active(self) -> Any:
        """The scaler when enabled, else ``None``."""
        scaler = self.scaler
        if scaler is None or (hasattr(scaler, "is_enabled") and not scaler.is_enabled()):
            return None
        return scaler

    def divisor(self, fisher: float) -> float | torch.Tensor:
        """What output gradients are divided by: the Fisher scale times the loss scale."""
        if self.scaler is None:
            return fisher
        scale = loss_scale(self.scaler)  # float32 on the scaler; the product in float64
        return fisher * (scale.double() if isinstance(scale, torch.Tensor) else scale)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, in ``loss``'s dtype.

        ``scaler.scale(loss)`` would round a float64 loss to float32; scaling a one creates
        the scaler's scale tensor on first use all the same.
        """
        scaler = self.active()
        if scaler is None:
            return loss
        one = torch.ones((), dtype=torch.float32, device=loss.device)
        scale: torch.Tensor = scaler.scale(one)
        return loss * scale.to(loss.dtype).reshape(())

    def unscale_non_finite(self, optimizer: torch.optim.Optimizer,
                           params: list[torch.Tensor]) -> bool:
        """Unscales the gradients of ``optimizer`` (if scaled); whether any is not finite."""
        scaler = self.active()
        try:
            if scaler is not None:
                scaler.unscale_(optimizer)
        except RuntimeError as err:
            raise ValueError(
                "KFAC drives its grad_scaler: call opt.step() (not scaler.step(opt)) and do "
                "not call scaler.unscale_(opt) or scaler.update()"
            ) from err
        grads = [p.grad for p in params if p.grad is not None]
        return bool(grads) and not bool(finite_each(grads).all())

    def skipped_step(self, step: int) -> str:
        """Why a step with non-finite gradients takes no update.

        An overflow of the loss scale (``'overflow'``), or, without a scaler, a fault of
        the batch or the model (``'non_finite_gradient'``, with a warning).
        """
        if self.active() is not None:
            return "overflow"
        warnings.warn(f"kaisa.KFAC: non-finite gradient at step {step} with a finite loss "
                      "(an infinite or NaN input?); no parameter changed",
                      RuntimeWarning, stacklevel=6)
        return "non_finite_gradient"

    def update(self) -> None:
        """Ends the step: the scaler adapts its scale."""
        scaler = self.active()
        if scaler is not None:
            scaler.update()
