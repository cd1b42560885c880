"""Eigendecomposition method: ``(G ⊗ A + damping I)^-1`` in the Kronecker eigenbasis.

Each factor ``F = Q diag(d) Q^T`` is sent as ``[Q, d]``; preconditioning is
``QG ((QG^T grad QA) / (dG dA^T + damping)) QA^T`` (:func:`kaisa.ops.eigen_precondition`),
with ``1 / (dG dA^T + damping)`` precomputed at decomposition time when
``outer_product`` (kfac-pytorch's ``compute_eigenvalue_outer_product``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa import linalg, ops
from kaisa.enums import Side
from kaisa.methods.base import Damping, Payload, SecondOrderMethod, State

__all__ = ["EigenMethod"]


class EigenMethod(SecondOrderMethod):
    """Eigendecompositions of A and G (kfac-pytorch's ``ComputeMethod.EIGEN``).

    Args:
        outer_product: Store ``1 / (dG dA^T + damping)`` at decomposition time.
    """

    state_keys = ("qa", "da", "qg", "dg", "dgda")
    symmetric = (False, False)

    def __init__(self, *, outer_product: bool = True) -> None:
        self.outer_product = outer_product

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        *,
        damping: Sequence[Damping],
        inv_dtype: torch.dtype,
        names: Sequence[str],
    ) -> list[Payload | None]:
        """See :meth:`SecondOrderMethod.decompose`; payload ``[Q, d]`` (damping unused)."""
        results = linalg.eigen_decompositions(factors, inv_dtype=inv_dtype, names=names)
        return [None if r is None else [r.eigenvectors, r.eigenvalues] for r in results]

    def payload_shapes(self, blocks: int, n: int) -> list[tuple[int, ...]]:
        """``[(blocks, n, n), (blocks, n)]``."""
        return [(blocks, n, n), (blocks, n)]

    def state_shapes(self, blocks: int, a_dim: int, g_dim: int) -> dict[str, tuple[int, ...]]:
        """``Q`` and ``d`` per factor and the ``(blocks, g_dim, a_dim)`` outer product."""
        return {"qa": (blocks, a_dim, a_dim), "da": (blocks, a_dim),
                "qg": (blocks, g_dim, g_dim), "dg": (blocks, g_dim),
                "dgda": (blocks, g_dim, a_dim)}

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float
    ) -> None:
        """Stores ``Q``/``d`` per factor and, when enabled, the damped outer product."""
        if a is not None:
            state["qa"], state["da"] = a
        if g is not None:
            state["qg"], state["dg"] = g
        changed = a is not None or g is not None or "dgda" not in state
        if self.outer_product and changed and "da" in state and "dg" in state:
            outer = state["dg"].unsqueeze(-1) * state["da"].unsqueeze(-2)
            state["dgda"] = 1.0 / (outer + damping)

    def stored(self, state: State, side: Side) -> Payload | None:
        """``[Q, d]`` of ``side`` if stored."""
        q, d = ("qa", "da") if side is Side.A else ("qg", "dg")
        return [state[q], state[d]] if q in state and d in state else None

    def required_keys(self) -> tuple[str, ...]:
        """Eigenvectors and eigenvalues of both factors."""
        return ("qa", "da", "qg", "dg")

    def precondition(
        self, state: State, grad: torch.Tensor, damping: float
    ) -> torch.Tensor | None:
        """``QG ((QG^T grad QA) / (dG dA^T + damping)) QA^T`` in the stored dtype."""
        if not self.ready(state):
            return None
        qa, qg = state["qa"], state["qg"]
        g = grad.to(qa.dtype)
        if "dgda" in state:
            out = ops.eigen_precondition(g, qa, qg, dgda=state["dgda"])
        else:
            out = ops.eigen_precondition(
                g, qa, qg, da=state["da"], dg=state["dg"], damping=damping
            )
        return out.to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int) -> int:
        """``Q`` and ``d`` of both factors, plus the outer product when stored."""
        outer = g_dim * a_dim if self.outer_product else 0
        return a_dim * a_dim + a_dim + g_dim * g_dim + g_dim + outer

    def decompose_flops(self, n: int) -> float:
        """A symmetric eigendecomposition with eigenvectors: about ``9 n^3``."""
        return 9.0 * n**3
