"""Losses the adaptive optimizer understands: value, sampled targets, Gauss-Newton products.

:class:`kaisa.KFAC` needs three things from the loss a user declares:

* its value on a batch (``torch.nn.functional``'s, with the declared reduction);
* targets sampled from the model's predictive distribution, for the Monte-Carlo Fisher
  (Gaussian with variance 1/2 for the squared error, whose per-element loss
  ``(f - y)^2`` is then the negative log-likelihood up to a constant; categorical for
  cross-entropy), and the square root of their gradients' covariance, for the type-2
  Fisher (``docs/conventions.md``, "Where ``kaisa.KFAC``'s G comes from");
* ``u^T H v`` for the Hessian ``H`` of the loss with respect to the model outputs, which
  with Jacobian-vector products gives the exact Gauss-Newton (type-2 Fisher) quadratic
  forms of the quadratic model.

``examples`` and ``scale`` relate the declared loss to per-example negative
log-likelihoods: ``loss = scale * sum_i l_i`` over ``examples`` terms.

Under torch.distributed each rank samples its :class:`Share` of the draw one process
makes on the global batch (``docs/conventions.md``, "Distribution").
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kaisa.utils.enums import LossKind, Reduction, parse_enum

__all__ = ["LOSSES", "CrossEntropyLoss", "Loss", "LossKind", "MSELoss", "Reduction", "Share"]


@dataclass(frozen=True)
class Share:
    """Which rows of a global batch a rank's outputs are: ``[index n, (index + 1) n)``.

    The global batch is ``count`` local batches of ``n`` rows (``n`` the local first
    dimension) in rank order; ``Share()`` is a whole batch (one process).

    Attributes:
        index: This rank's position (its rank).
        count: How many equal shares (the world size).
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int)
                and 0 <= self.index < self.count):
            raise ValueError(f"a Share needs integers 0 <= index < count, got index "
                             f"{self.index!r} and count {self.count!r}")

    def draw(
        self, noise: Callable[[tuple[int, ...]], torch.Tensor], shape: torch.Size
    ) -> torch.Tensor:
        """This share's rows of ``noise`` drawn for the global batch.

        Args:
            noise: Draws a tensor of the given shape (advancing its generator).
            shape: The local shape ``(n, ...)``.

        Returns:
            ``noise((count n, ...))[index n : (index + 1) n]`` (the whole draw when
            ``count`` is 1).
        """
        if self.count == 1:
            return noise(tuple(shape))
        n = shape[0]
        return noise((self.count * n, *shape[1:]))[self.index * n : (self.index + 1) * n]


class Loss(abc.ABC):
    """A declared loss and its reduction; one subclass per loss.

    Build one with :meth:`Loss.of`. Attributes:
        kind: Which loss.
        reduction: ``MEAN`` or ``SUM``.
    """

    kind: ClassVar[LossKind]

    def __init__(self, reduction: Reduction) -> None:
        self.reduction = reduction

    @staticmethod
    def of(kind: LossKind | str, reduction: Reduction | str = Reduction.MEAN) -> Loss:
        """Parses names (``'mse'``, ``'cross_entropy'``; ``'mean'``, ``'sum'``)."""
        cls = LOSSES[parse_enum(LossKind, kind, "loss")]
        return cls(parse_enum(Reduction, reduction, "reduction"))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Loss) and other.kind is self.kind
                and other.reduction is self.reduction)

    def __hash__(self) -> int:
        return hash((self.kind, self.reduction))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction.value!r})"

    @abc.abstractmethod
    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss value."""

    @abc.abstractmethod
    def examples(self, outputs: torch.Tensor) -> int:
        """Number of per-example terms ``l_i``."""

    def scale(self, outputs: torch.Tensor) -> float:
        """``c`` in ``loss = c * sum_i l_i`` (``l_i`` summed over an example's elements)."""
        if self.reduction is Reduction.SUM:
            return 1.0
        return 1.0 / self._mean_count(outputs)

    @abc.abstractmethod
    def _mean_count(self, outputs: torch.Tensor) -> int:
        """What the ``'mean'`` reduction divides by."""

    @abc.abstractmethod
    def sample_targets(
        self, outputs: torch.Tensor, generator: torch.Generator | None = None,
        share: Share = Share(),
    ) -> torch.Tensor:
        """Targets drawn from the model's predictive distribution at ``outputs``.

        ``share``: which rows of the global batch ``outputs`` are; the noise is drawn for
        the global batch (on the CPU, from ``generator``) and this share's rows kept.
        """

    @abc.abstractmethod
    def fisher_sqrt(self, outputs: torch.Tensor) -> torch.Tensor:
        """The output gradients of the type-2 Fisher's backward passes, stacked.

        Column ``k`` (``out[k]``, the shape of ``outputs``) holds ``c S_i[:, k]`` at every
        position ``i`` (an element of ``outputs`` but its last dimension), ``S_i`` a
        factor of the position's negative log-likelihood Hessian ``H_i = S_i S_i^T``, so
        that at each position ``sum_k out[k]_i out[k]_i^T`` is the covariance of the
        loss's output gradient at targets from :meth:`sample_targets`.

        Returns:
            ``(K, *outputs.shape)``, in ``outputs``' dtype, no graph.
        """

    @abc.abstractmethod
    def gauss_newton(
        self, outputs: torch.Tensor, ju: torch.Tensor, jv: torch.Tensor
    ) -> torch.Tensor:
        """``(J u)^T H (J v)``, ``H`` the loss Hessian w.r.t. the outputs (0-d, float64)."""


class MSELoss(Loss):
    """``F.mse_loss``: Gaussian likelihood with variance 1/2; ``H = 2 c I``."""

    kind = LossKind.MSE

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss value.

        Raises:
            ValueError: Unless ``targets`` has the shape of ``outputs`` (no broadcasting
                or reshaping: a ``(N, 1)`` output needs ``(N, 1)`` targets).
        """
        if targets.shape != outputs.shape:
            raise ValueError(
                f"mse targets of shape {_shape(targets)} do not match outputs of shape "
                f"{_shape(outputs)}; they must have the same shape"
            )
        value: torch.Tensor = F.mse_loss(outputs, targets, reduction=self.reduction.value)
        return value

    def examples(self, outputs: torch.Tensor) -> int:
        """Rows."""
        return int(outputs.shape[0])

    def _mean_count(self, outputs: torch.Tensor) -> int:
        return outputs.numel()

    def sample_targets(
        self, outputs: torch.Tensor, generator: torch.Generator | None = None,
        share: Share = Share(),
    ) -> torch.Tensor:
        """``f + N(0, 1/2)`` noise."""
        f = outputs.detach()
        noise = share.draw(
            lambda shape: torch.randn(shape, generator=generator, dtype=f.dtype, device="cpu"),
            f.shape,
        )
        sampled: torch.Tensor = f + noise.to(f.device) * (0.5**0.5)
        return sampled

    def fisher_sqrt(self, outputs: torch.Tensor) -> torch.Tensor:
        """``S_i = sqrt(2) I`` over the last dimension (one column for 0-d or 1-D outputs).

        ``H_i = 2 I``: the gradient of ``c (f - y)^2`` at ``y ~ f + N(0, 1/2)`` has
        covariance ``2 c^2`` per element, elements independent.
        """
        f = outputs.detach()
        if f.dim() <= 1:
            return torch.full((1, *f.shape), self.scale(f) * 2.0**0.5, dtype=f.dtype,
                              device=f.device)
        k = f.shape[-1]
        eye = torch.eye(k, dtype=f.dtype, device=f.device) * (self.scale(f) * 2.0**0.5)
        columns: torch.Tensor = eye.reshape(k, *([1] * (f.dim() - 1)), k).expand(k, *f.shape)
        return columns.clone()

    def gauss_newton(
        self, outputs: torch.Tensor, ju: torch.Tensor, jv: torch.Tensor
    ) -> torch.Tensor:
        """``2 c (J u).(J v)``."""
        return 2.0 * (ju.double() * jv.double()).sum() * self.scale(outputs)


class CrossEntropyLoss(Loss):
    """``F.cross_entropy`` with class logits in the last dimension and integer targets.

    Outputs ``(..., C)`` (e.g. ``(N, C)``, or ``(B, T, C)`` for a sequence model) take
    class indices of shape ``(...)``. The class dimension is the last one, not torch's
    dimension 1: a model's logits need no permute.
    """

    kind = LossKind.CROSS_ENTROPY

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss value over every position.

        Raises:
            ValueError: Unless ``targets`` has the shape of ``outputs`` without its last
                (class) dimension.
        """
        if outputs.dim() == 0 or targets.shape != outputs.shape[:-1]:
            raise ValueError(
                f"cross_entropy targets of shape {_shape(targets)} do not match outputs of "
                f"shape {_shape(outputs)}; with class logits in the last dimension the "
                f"targets (class indices) must have shape {_shape(outputs)[:-1]}"
            )
        logits = outputs.reshape(-1, outputs.shape[-1])
        value: torch.Tensor = F.cross_entropy(
            logits, targets.reshape(-1), reduction=self.reduction.value
        )
        return value

    def examples(self, outputs: torch.Tensor) -> int:
        """Positions (every element but the class dimension)."""
        return outputs.numel() // outputs.shape[-1]

    def _mean_count(self, outputs: torch.Tensor) -> int:
        return self.examples(outputs)

    def sample_targets(
        self, outputs: torch.Tensor, generator: torch.Generator | None = None,
        share: Share = Share(),
    ) -> torch.Tensor:
        """Classes drawn from ``softmax(outputs)``: ``argmax_k p_k / E_k``, ``E ~ Exp(1)``.

        The exponential race, ``torch.multinomial``'s algorithm for one sample (with
        ``Share()`` the classes equal ``torch.multinomial(p, 1, generator=generator)``'s),
        written out so that a rank can keep its rows of the global draw.
        """
        f = outputs.detach()
        probs = torch.softmax(f.reshape(-1, f.shape[-1]).float(), dim=-1).cpu()
        race = share.draw(
            lambda shape: torch.empty(shape, dtype=probs.dtype).exponential_(generator=generator),
            probs.shape,
        )
        drawn = (probs / race).argmax(-1).reshape(f.shape[:-1])
        return drawn.to(f.device)

    def fisher_sqrt(self, outputs: torch.Tensor) -> torch.Tensor:
        """``S_i = diag(sqrt(p_i)) - p_i sqrt(p_i)^T``, ``p_i`` the position's softmax.

        ``S_i S_i^T = diag(p_i) - p_i p_i^T = H_i`` (curvlinops' factor: the same
        columns). Computed in float64.
        """
        f = outputs.detach()
        p = torch.softmax(f.double(), dim=-1)
        root = p.sqrt()
        # S[..., a, k] = [a == k] sqrt(p_a) - p_a sqrt(p_k); column k is S[..., :, k]
        s = torch.diag_embed(root) - p.unsqueeze(-1) * root.unsqueeze(-2)
        columns = (s * self.scale(f)).movedim(-1, 0)
        return columns.to(f.dtype).contiguous()

    def gauss_newton(
        self, outputs: torch.Tensor, ju: torch.Tensor, jv: torch.Tensor
    ) -> torch.Tensor:
        """``c sum_i a_i^T (diag(p_i) - p_i p_i^T) b_i``."""
        p = torch.softmax(outputs.detach().double().reshape(-1, outputs.shape[-1]), dim=-1)
        a, b = ju.double().reshape(p.shape), jv.double().reshape(p.shape)
        form = (p * a * b).sum() - ((p * a).sum(-1) * (p * b).sum(-1)).sum()
        return form * self.scale(outputs)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


#: The loss class of each kind.
LOSSES: dict[LossKind, type[Loss]] = {
    LossKind.MSE: MSELoss,
    LossKind.CROSS_ENTROPY: CrossEntropyLoss,
}
