"""Eigendecomposition method: ``(G ⊗ A + damping I)^-1`` in the Kronecker eigenbasis.

Each factor ``F = Q diag(d) Q^T`` is sent as ``[Q, d]``; preconditioning is
``QG ((QG^T grad QA) / (dG dA^T + damping)) QA^T`` (:func:`kaisa.ops.eigen_precondition`),
with ``1 / (dG dA^T + damping)`` precomputed at decomposition time when
``outer_product`` (kfac-pytorch's ``compute_eigenvalue_outer_product``).

A diagonal factor's eigenvectors are the identity: it is sent as ``[d]`` (``d`` the
diagonal clamped at 0) and its side is not rotated. That path is plain torch: the
kernel of :func:`kaisa.ops.eigen_precondition` takes both rotations, and the identity
``V x V`` it would need is what a diagonal side exists to avoid (its two remaining
products are single matmuls, which the kernel would not make faster).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kaisa import ops
from kaisa.methods import linalg
from kaisa.methods.base import DENSE, Batch, Damping, Diagonal, Payload, SecondOrderMethod, State
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import Side

__all__ = ["EigenMethod"]


class EigenMethod(SecondOrderMethod):
    """Eigendecompositions of A and G (kfac-pytorch's ``ComputeMethod.EIGEN``).

    Args:
        outer_product: Store ``1 / (dG dA^T + damping)`` at decomposition time.
    """

    state_keys: tuple[str, ...] = ("qa", "da", "qg", "dg", "dgda")
    symmetric = (False, False)
    batched = True

    def __init__(self, *, outer_product: bool = True) -> None:
        self.outer_product = outer_product

    def decompose_dense(self, batch: Batch) -> list[Payload | None]:
        """See :meth:`SecondOrderMethod.decompose`; payload ``[Q, d]`` (damping unused)."""
        results = linalg.eigen_decompositions(batch.factors, inv_dtype=batch.inv_dtype,
                                              names=batch.names)
        return [None if r is None else [r.eigenvectors, r.eigenvalues] for r in results]

    def refresh_dense(
        self, batch: Batch, previous: Sequence[Payload | None]
    ) -> list[Payload | None]:
        """Warm-started bases: one subspace-iteration step from the stored eigenvectors.

        :func:`kaisa.methods.linalg.warm_eigen_decompositions` (``eigh`` where none is
        stored or the step is not finite); the eigenvalues are the estimates
        ``diag(Q0^T F Q0)``.
        """
        results = linalg.warm_eigen_decompositions(
            batch.factors, [None if p is None else p[0] for p in previous],
            inv_dtype=batch.inv_dtype, names=batch.names)
        return [None if r is None else [r.eigenvectors, r.eigenvalues] for r in results]

    def decompose_diagonal(
        self, factor: torch.Tensor, damping: Damping, inv_dtype: torch.dtype
    ) -> Payload:
        """``[max(a, 0)]``: the eigenvalues of ``diag(a)`` (damping unused)."""
        return [factor.to(working_dtype(inv_dtype)).clamp(min=0.0).to(inv_dtype)]

    def payload_shapes(
        self, blocks: int, n: int, *, diagonal: bool = False
    ) -> list[tuple[int, ...]]:
        """``[(blocks, n, n), (blocks, n)]``; ``[(blocks, n)]`` for a diagonal."""
        return [(blocks, n)] if diagonal else [(blocks, n, n), (blocks, n)]

    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """``Q`` (not for a diagonal side) and ``d`` per factor, and the outer product."""
        shapes: dict[str, tuple[int, ...]] = {}
        for side, n in ((Side.A, a_dim), (Side.G, g_dim)):
            q, d = _keys(side)
            if side not in diagonal:
                shapes[q] = (blocks, n, n)
            shapes[d] = (blocks, n)
        shapes["dgda"] = (blocks, g_dim, a_dim)
        return {key: shapes[key] for key in self.state_keys if key in shapes}

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float,
        diagonal: Diagonal = DENSE,
    ) -> None:
        """Stores ``Q``/``d`` per factor and, when enabled, the damped outer product."""
        for side, payload in ((Side.A, a), (Side.G, g)):
            if payload is None:
                continue
            q, d = _keys(side)
            if side in diagonal:
                (state[d],) = payload
            else:
                state[q], state[d] = payload
        changed = a is not None or g is not None or "dgda" not in state
        if self.outer_product and changed and "da" in state and "dg" in state:
            outer = state["dg"].unsqueeze(-1) * state["da"].unsqueeze(-2)
            state["dgda"] = 1.0 / (outer + damping)

    def stored(self, state: State, side: Side, *, diagonal: Diagonal = DENSE) -> Payload | None:
        """``[Q, d]`` (``[d]`` for a diagonal side) of ``side`` if stored."""
        q, d = _keys(side)
        if side in diagonal:
            return [state[d]] if d in state else None
        return [state[q], state[d]] if q in state and d in state else None

    def required_keys(self, *, diagonal: Diagonal = DENSE) -> tuple[str, ...]:
        """Eigenvectors (of dense sides) and eigenvalues of both factors."""
        keys: list[str] = []
        for side in (Side.A, Side.G):
            q, d = _keys(side)
            keys += [d] if side in diagonal else [q, d]
        return tuple(keys)

    def precondition(
        self, state: State, grad: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> torch.Tensor | None:
        """``QG ((QG^T grad QA) / (dG dA^T + damping)) QA^T`` in the stored dtype.

        A diagonal side has no ``Q``: it is not rotated.
        """
        if not self.ready(state, diagonal=diagonal):
            return None
        if diagonal:
            return self._precondition_diagonal(state, grad, damping, diagonal)
        qa, qg = state["qa"], state["qg"]
        g = grad.to(qa.dtype)
        if "dgda" in state:
            out = ops.eigen_precondition(g, qa, qg, dgda=state["dgda"])
        else:
            out = ops.eigen_precondition(
                g, qa, qg, da=state["da"], dg=state["dg"], damping=damping
            )
        return out.to(grad.dtype)

    @staticmethod
    def _precondition_diagonal(
        state: State, grad: torch.Tensor, damping: float, diagonal: Diagonal
    ) -> torch.Tensor:
        """The same product with the rotations of the diagonal sides left out."""
        qa = None if Side.A in diagonal else state["qa"]
        qg = None if Side.G in diagonal else state["qg"]
        v = grad.to(state["da"].dtype)
        if qg is not None:
            v = qg.transpose(-1, -2) @ v
        if qa is not None:
            v = v @ qa
        if "dgda" in state:
            v = v * state["dgda"]
        else:
            v = v / (state["dg"].unsqueeze(-1) * state["da"].unsqueeze(-2) + damping)
        if qa is not None:
            v = v @ qa.transpose(-1, -2)
        if qg is not None:
            v = qg @ v
        return v.to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """``Q`` (dense sides) and ``d`` of both factors, plus the outer product if stored."""
        outer = g_dim * a_dim if self.outer_product else 0
        qa = 0 if Side.A in diagonal else a_dim * a_dim
        qg = 0 if Side.G in diagonal else g_dim * g_dim
        return qa + a_dim + qg + g_dim + outer

    def decompose_flops(self, n: int, *, diagonal: bool = False) -> float:
        """A symmetric eigendecomposition with eigenvectors: about ``9 n^3`` (diagonal: ``n``)."""
        return float(n) if diagonal else 9.0 * n**3


def _keys(side: Side) -> tuple[str, str]:
    return ("qa", "da") if side is Side.A else ("qg", "dg")
