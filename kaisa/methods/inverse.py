"""Inverse method: damped inverses of the factors (kfac-pytorch's INVERSE).

Each factor ``F`` is sent as ``[(F + damping I)^-1]`` (Cholesky, with the float64 retry
ladder of :func:`kaisa.methods.linalg.damped_inverses`); preconditioning is
``G_inv @ grad @ A_inv``. The inverses are symmetric, so ``symmetry_aware`` sends their
upper triangles only. A diagonal factor ``a`` is sent as ``[1 / (a + damping)]`` and
scales the gradient's columns (A) or rows (G).
"""

from __future__ import annotations

import math

import torch

from kaisa.methods import linalg
from kaisa.methods.base import DENSE, Batch, Damping, Diagonal, Payload, SecondOrderMethod, State
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import Side

__all__ = ["InverseMethod", "PiInverseMethod"]


class InverseMethod(SecondOrderMethod):
    """Damped inverses of A and G (kfac-pytorch's ``ComputeMethod.INVERSE``)."""

    state_keys = ("a_inv", "g_inv")
    symmetric = (True,)
    batched = True

    def decompose_dense(self, batch: Batch) -> list[Payload | None]:
        """See :meth:`SecondOrderMethod.decompose`; payload ``[(F + damping I)^-1]``."""
        inverses = linalg.damped_inverses(batch.factors, damping=batch.damping,
                                          inv_dtype=batch.inv_dtype, names=batch.names)
        return [None if inv is None else [inv] for inv in inverses]

    def decompose_diagonal(
        self, factor: torch.Tensor, damping: Damping, inv_dtype: torch.dtype
    ) -> Payload:
        """``[1 / (a + damping)]`` (per-block damping broadcast over the diagonal)."""
        dtype = working_dtype(inv_dtype)
        a = factor.to(dtype)
        if isinstance(damping, torch.Tensor):
            damping = damping.to(dtype).reshape(-1, 1)
        return [(1.0 / (a + damping)).to(inv_dtype)]

    def payload_shapes(
        self, blocks: int, n: int, *, diagonal: bool = False
    ) -> list[tuple[int, ...]]:
        """``[(blocks, n, n)]``; ``[(blocks, n)]`` for a diagonal."""
        return [(blocks, n)] if diagonal else [(blocks, n, n)]

    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """One inverse per factor (its diagonal for a diagonal side)."""
        return {
            "a_inv": (blocks, a_dim) if Side.A in diagonal else (blocks, a_dim, a_dim),
            "g_inv": (blocks, g_dim) if Side.G in diagonal else (blocks, g_dim, g_dim),
        }

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float,
        diagonal: Diagonal = DENSE,
    ) -> None:
        """Stores the inverses (``None`` keeps the previous one)."""
        if a is not None:
            state["a_inv"] = a[0]
        if g is not None:
            state["g_inv"] = g[0]

    def stored(self, state: State, side: Side, *, diagonal: Diagonal = DENSE) -> Payload | None:
        """``[inverse]`` of ``side`` if stored."""
        key = "a_inv" if side is Side.A else "g_inv"
        return [state[key]] if key in state else None

    def precondition(
        self, state: State, grad: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> torch.Tensor | None:
        """``G_inv @ grad @ A_inv`` in the stored dtype (a diagonal inverse scales)."""
        if not self.ready(state, diagonal=diagonal):
            return None
        a_inv, g_inv = state["a_inv"], state["g_inv"]
        if not diagonal:
            return (g_inv @ grad.to(a_inv.dtype) @ a_inv).to(grad.dtype)
        v = grad.to(a_inv.dtype)
        v = g_inv.unsqueeze(-1) * v if Side.G in diagonal else g_inv @ v
        v = v * a_inv.unsqueeze(-2) if Side.A in diagonal else v @ a_inv
        return v.to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """Both inverses (``n`` elements for a diagonal side)."""
        a = a_dim if Side.A in diagonal else a_dim * a_dim
        g = g_dim if Side.G in diagonal else g_dim * g_dim
        return a + g

    def decompose_flops(self, n: int, *, diagonal: bool = False) -> float:
        """Cholesky (``n^3/3``) and the inverse from it (``2 n^3/3``); diagonal: ``n``."""
        return float(n) if diagonal else 1.0 * n**3


class PiInverseMethod(InverseMethod):
    """Factored Tikhonov damping with the ``pi`` adjustment (Martens & Grosse 2015, 6.3).

    ``A_inv = (A + pi sqrt(damping) I)^-1`` and ``G_inv = (G + sqrt(damping)/pi I)^-1``
    with ``pi = sqrt((tr(A)/dim A) / (tr(G)/dim G))`` per block (``pi = 1`` where a trace
    is not positive and finite): ``A_inv (x) G_inv`` approximates
    ``(A (x) G + damping I)^-1`` at the cost of two Cholesky inverses, about a quarter of
    two eigendecompositions (kfac-jax's default for dense layers). As with the inverse
    method, the damping is the one of the step that decomposed.
    """

    def factor_damping(
        self, a: torch.Tensor, g: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> tuple[Damping, Damping]:
        """``(pi sqrt(damping), sqrt(damping) / pi)`` per block, float64.

        ``tr(F) / dim F`` is the mean of a diagonal side's entries.
        """
        mean_a = _diagonal(a, Side.A in diagonal).double().mean(-1)
        mean_g = _diagonal(g, Side.G in diagonal).double().mean(-1)
        ratio = mean_a / mean_g
        usable = (mean_a > 0) & (mean_g > 0) & torch.isfinite(ratio)
        pi = torch.where(usable, ratio, torch.ones_like(ratio)).sqrt()
        root = math.sqrt(damping)
        return pi * root, root / pi


def _diagonal(factor: torch.Tensor, is_diagonal: bool) -> torch.Tensor:
    """The diagonal ``(blocks, n)`` of a factor kept dense or as its diagonal."""
    return factor if is_diagonal else factor.diagonal(dim1=-2, dim2=-1)
