"""Inverse method: damped inverses of the factors (kfac-pytorch's INVERSE).

Each factor ``F`` is sent as ``[(F + damping I)^-1]`` (Cholesky, with the float64 retry
ladder of :func:`kaisa.linalg.damped_inverses`); preconditioning is
``G_inv @ grad @ A_inv``. The inverses are symmetric, so ``symmetry_aware`` sends their
upper triangles only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa import linalg
from kaisa.enums import ComputeMethod
from kaisa.methods.base import FactorSide, Payload, SecondOrderMethod, State

__all__ = ["InverseMethod"]


class InverseMethod(SecondOrderMethod):
    """Damped inverses of A and G (kfac-pytorch's ``ComputeMethod.INVERSE``)."""

    kind = ComputeMethod.INVERSE
    state_keys = ("a_inv", "g_inv")
    symmetric = (True,)

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        *,
        damping: float,
        inv_dtype: torch.dtype,
        names: Sequence[str],
    ) -> list[Payload | None]:
        """See :meth:`SecondOrderMethod.decompose`; payload ``[(F + damping I)^-1]``."""
        inverses = linalg.damped_inverses(
            factors, damping=damping, inv_dtype=inv_dtype, names=names
        )
        return [None if inv is None else [inv] for inv in inverses]

    def payload_shapes(self, blocks: int, n: int) -> list[tuple[int, ...]]:
        """``[(blocks, n, n)]``."""
        return [(blocks, n, n)]

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float
    ) -> None:
        """Stores the inverses (``None`` keeps the previous one)."""
        if a is not None:
            state["a_inv"] = a[0]
        if g is not None:
            state["g_inv"] = g[0]

    def stored(self, state: State, side: FactorSide) -> Payload | None:
        """``[inverse]`` of ``side`` if stored."""
        key = "a_inv" if side == "A" else "g_inv"
        return [state[key]] if key in state else None

    def precondition(
        self, state: State, grad: torch.Tensor, damping: float
    ) -> torch.Tensor | None:
        """``G_inv @ grad @ A_inv`` in the stored dtype."""
        if not self.ready(state):
            return None
        a_inv, g_inv = state["a_inv"], state["g_inv"]
        return (g_inv @ grad.to(a_inv.dtype) @ a_inv).to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int) -> int:
        """Both inverses."""
        return a_dim * a_dim + g_dim * g_dim

    def decompose_flops(self, n: int) -> float:
        """Cholesky (``n^3/3``) and the inverse from it (``2 n^3/3``)."""
        return 1.0 * n**3
