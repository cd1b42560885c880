"""EKFAC's method: Adam's moments in the Kronecker eigenbasis (``docs/conventions.md``).

:class:`EigenAdamMethod` is the eigen method (``F = Q diag(d) Q^T`` per factor, the
warm-started refresh of :meth:`~kaisa.methods.EigenMethod.refresh_dense`) whose block
state also holds Adam's moments ``exp_avg`` and ``exp_avg_sq`` in that basis. They live
where the bases live (a block's gradient workers), are checkpointed and gathered with
them, and follow them: :meth:`EigenAdamMethod.install` rotates them into a new basis
before storing it. :meth:`EigenAdamMethod.adam_step` is the per-block step a product runs
through :meth:`kaisa.core.curvature.KFACCurvature.transform`. A side without a basis (a
diagonal side, or none computed yet) is the identity.
"""

from __future__ import annotations

import torch

from kaisa.methods.base import DENSE, Diagonal, Payload, State
from kaisa.methods.eigen import EigenMethod
from kaisa.utils.enums import Side
from kaisa.utils.first_order import AdamStep, adam_moments

__all__ = ["EigenAdamMethod"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class EigenAdamMethod(EigenMethod):
    """Eigenbases of A and G with Adam's moments in them (no eigenvalue outer product)."""

    state_keys = ("qa", "da", "qg", "dg", *_MOMENTS)

    def __init__(self) -> None:
        super().__init__(outer_product=False)

    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """The eigen method's entries, and both moments ``(blocks, g_dim, a_dim)``."""
        shapes = super().state_shapes(blocks, a_dim, g_dim, diagonal=diagonal)
        return shapes | dict.fromkeys(_MOMENTS, (blocks, g_dim, a_dim))

    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """The bases and eigenvalues, and the two moments."""
        return super().numel(a_dim, g_dim, diagonal=diagonal) + 2 * g_dim * a_dim

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float,
        diagonal: Diagonal = DENSE,
    ) -> None:
        """Carries the moments into the new bases, then stores them.

        With ``R = Q_old^T Q_new`` per changed side (``Q_old`` the identity before the
        first basis): ``m <- RG^T m RA``, ``v <- (RG * RG)^T v (RA * RA)``. A basis equal
        to the stored one (resent after a failed refresh) leaves the moments as they are.
        """
        change: dict[Side, torch.Tensor] = {}
        for side, payload, key in ((Side.A, a, "qa"), (Side.G, g, "qg")):
            if payload is None or side in diagonal:
                continue
            old, new = state.get(key), payload[0]
            if old is None:
                change[side] = new
            elif not torch.equal(old, new):  # a resent previous basis changes nothing
                change[side] = old.mT @ new
        if change and "exp_avg" in state:
            ra, rg = change.get(Side.A), change.get(Side.G)
            state["exp_avg"] = _rotate(rg, state["exp_avg"], ra)
            state["exp_avg_sq"] = _rotate(None if rg is None else rg * rg, state["exp_avg_sq"],
                                          None if ra is None else ra * ra)
        super().install(state, a, g, damping=damping, diagonal=diagonal)

    def adam_step(
        self, state: State, grad: torch.Tensor, step: AdamStep, *, dtype: torch.dtype,
        diagonal: Diagonal = DENSE,
    ) -> torch.Tensor:
        """One Adam step in the block's eigenbasis: ``QG ((s m) / denom) QA^T``.

        ``r = QG^T grad QA`` updates the moments (created as zeros in ``dtype``), and
        :meth:`~kaisa.utils.first_order.AdamStep.update` of them is rotated back.

        Args:
            state: The block's state (bases and moments; the moments are updated).
            grad: The gradient matrix ``(blocks, m, n)``.
            step: The step's scalars.
            dtype: The moments' dtype (the bases').
            diagonal: The block's diagonal sides (identity bases).

        Returns:
            The update ``u`` in ``grad``'s dtype.
        """
        qa = None if Side.A in diagonal else state.get("qa")
        qg = None if Side.G in diagonal else state.get("qg")
        r = _rotate(qg, grad.to(dtype), qa)
        if "exp_avg" not in state:
            for key in _MOMENTS:
                state[key] = torch.zeros_like(r)
        adam_moments(state["exp_avg"], state["exp_avg_sq"], r, step.beta1, step.beta2)
        update = step.update(state["exp_avg"], state["exp_avg_sq"])
        if qa is not None:
            update = _mm(update, qa.mT)
        if qg is not None:
            update = _mm(qg, update)
        return update.to(grad.dtype)


def _rotate(
    left: torch.Tensor | None, x: torch.Tensor, right: torch.Tensor | None
) -> torch.Tensor:
    """``left^T x right`` (a missing factor is the identity)."""
    if left is not None:
        x = _mm(left.mT, x)
    if right is not None:
        x = _mm(x, right)
    return x


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; of two stacks of one batch, ``bmm`` itself.

    ``bmm`` is what ``@`` runs for them, without the views around it: one operator call
    where ``@`` dispatches about six.
    """
    if a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0]:
        return torch.bmm(a, b)
    return a @ b
