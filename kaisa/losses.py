"""Losses the adaptive optimizer understands: value, sampled targets, Gauss-Newton products.

:class:`kaisa.KFAC` needs three things from the loss a user declares:

* its value on a batch (``torch.nn.functional``'s, with the declared reduction);
* targets sampled from the model's predictive distribution, for the Monte-Carlo Fisher
  (Gaussian with variance 1/2 for the squared error, whose per-element loss
  ``(f - y)^2`` is then the negative log-likelihood up to a constant; categorical for
  cross-entropy);
* ``u^T H v`` for the Hessian ``H`` of the loss with respect to the model outputs, which
  with Jacobian-vector products gives the exact Gauss-Newton (type-2 Fisher) quadratic
  forms of the quadratic model.

``examples`` and ``scale`` relate the declared loss to per-example negative
log-likelihoods: ``loss = scale * sum_i l_i`` over ``examples`` terms.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kaisa.enums import parse_enum

__all__ = ["Loss", "LossKind", "Reduction"]


class LossKind(enum.Enum):
    """The declared loss."""

    MSE = "mse"
    CROSS_ENTROPY = "cross_entropy"


class Reduction(enum.Enum):
    """How the loss is reduced over examples (``torch.nn.functional``'s names)."""

    MEAN = "mean"
    SUM = "sum"


@dataclass(frozen=True)
class Loss:
    """A declared loss and reduction.

    Attributes:
        kind: ``MSE`` (``F.mse_loss``) or ``CROSS_ENTROPY`` (``F.cross_entropy`` with
            class logits in the last dimension and integer targets).
        reduction: ``MEAN`` or ``SUM``.
    """

    kind: LossKind
    reduction: Reduction

    @classmethod
    def of(cls, kind: LossKind | str, reduction: Reduction | str = Reduction.MEAN) -> Loss:
        """Parses names (``'mse'``, ``'cross_entropy'``; ``'mean'``, ``'sum'``)."""
        return cls(
            parse_enum(LossKind, kind, "loss"), parse_enum(Reduction, reduction, "reduction")
        )

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss value."""
        reduction = self.reduction.value
        if self.kind is LossKind.MSE:
            mse: torch.Tensor = F.mse_loss(
                outputs, targets.reshape(outputs.shape), reduction=reduction
            )
            return mse
        logits = outputs.reshape(-1, outputs.shape[-1])
        value: torch.Tensor = F.cross_entropy(logits, targets.reshape(-1), reduction=reduction)
        return value

    def examples(self, outputs: torch.Tensor) -> int:
        """Number of per-example terms: rows for MSE, positions for cross-entropy."""
        if self.kind is LossKind.MSE:
            return int(outputs.shape[0])
        return outputs.numel() // outputs.shape[-1]

    def scale(self, outputs: torch.Tensor) -> float:
        """``c`` in ``loss = c * sum_i l_i`` (``l_i`` summed over an example's elements)."""
        if self.reduction is Reduction.SUM:
            return 1.0
        return 1.0 / (outputs.numel() if self.kind is LossKind.MSE else self.examples(outputs))

    def sample_targets(
        self, outputs: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Targets drawn from the model's predictive distribution at ``outputs``."""
        f = outputs.detach()
        if self.kind is LossKind.MSE:
            noise = torch.randn(f.shape, generator=generator, dtype=f.dtype, device="cpu")
            sampled: torch.Tensor = f + noise.to(f.device) * (0.5**0.5)
            return sampled
        probs = torch.softmax(f.reshape(-1, f.shape[-1]).float(), dim=-1).cpu()
        drawn = torch.multinomial(probs, 1, generator=generator).reshape(f.shape[:-1])
        return drawn.to(f.device)

    def gauss_newton(
        self, outputs: torch.Tensor, ju: torch.Tensor, jv: torch.Tensor
    ) -> torch.Tensor:
        """``(J u)^T H (J v)``, ``H`` the loss Hessian w.r.t. the outputs (0-d, float64)."""
        a, b = ju.double(), jv.double()
        if self.kind is LossKind.MSE:
            form = 2.0 * (a * b).sum()
        else:
            p = torch.softmax(outputs.detach().double().reshape(-1, outputs.shape[-1]), dim=-1)
            a, b = a.reshape(p.shape), b.reshape(p.shape)
            form = (p * a * b).sum() - ((p * a).sum(-1) * (p * b).sum(-1)).sum()
        return form * self.scale(outputs)
