"""KFACMuon's block state: Newton-Muon's input inverse and Muon's momentum buffer.

:class:`InputMuonMethod` is the second-order method of ``curvature='input'`` and
``'identity'``: a block's state is ``a_inv`` (``M = (A / k + ridge I)^-1``,
:func:`input_inverse`; absent for ``'identity'`` and before statistics) and
``momentum_buffer``, both kept where the block is preconditioned (its gradient workers) and
checkpointed with the decompositions. The product computes ``M`` itself on a refresh step
from the block's running ``A`` (the engine never decomposes: there is no ``G``); the
method says which entries exist, their shapes and how ``M`` is applied. ``'eigen'`` uses
EKFAC's :class:`~kaisa.methods.EigenAdamMethod`.
"""

from __future__ import annotations

import torch

from kaisa.methods import linalg
from kaisa.methods.base import DENSE, Batch, Damping, Diagonal, Payload, SecondOrderMethod, State
from kaisa.utils.enums import Side

__all__ = ["InputMuonMethod", "input_inverse"]


def input_inverse(
    a: torch.Tensor, ridge: float, inv_dtype: torch.dtype, name: str = "A"
) -> torch.Tensor:
    """``M = (A / k + ridge I)^-1`` per block of ``a`` ``(blocks, n, n)``, ``k = mean(diag A)``.

    Blocks whose ``k`` is not finite and positive, or whose inverse fails even in float64,
    get the identity.

    Returns:
        ``(blocks, n, n)`` in ``inv_dtype``.
    """
    k = a.diagonal(dim1=-2, dim2=-1).mean(-1)
    usable = torch.isfinite(k) & (k > 0)
    scale = torch.where(usable, k, torch.ones_like(k))
    inverse = linalg.damped_inverses([a / scale[:, None, None]], damping=ridge,
                                     inv_dtype=inv_dtype, names=[name])[0]
    eye = torch.eye(a.shape[-1], dtype=inv_dtype, device=a.device).expand_as(a)
    if inverse is None:
        return eye.clone()
    return torch.where(usable[:, None, None], inverse, eye)


class InputMuonMethod(SecondOrderMethod):
    """``a_inv`` and ``momentum_buffer`` per block; preconditioning is ``g @ a_inv``."""

    state_keys = ("a_inv", "momentum_buffer")
    symmetric = (True,)
    batched = True

    def __init__(self, ridge: float) -> None:
        self.ridge = ridge

    def decompose_dense(self, batch: Batch) -> list[Payload | None]:
        """``[M]`` of each A batch (:func:`input_inverse`; the damping is the ridge's)."""
        return [[input_inverse(f, self.ridge, batch.inv_dtype, name)]
                for f, name in zip(batch.factors, batch.names, strict=True)]

    def decompose_diagonal(
        self, factor: torch.Tensor, damping: Damping, inv_dtype: torch.dtype
    ) -> Payload:
        """Not used: KFACMuon's blocks are dense and one-sided."""
        raise NotImplementedError("KFACMuon's input curvature has no diagonal side")

    def payload_shapes(
        self, blocks: int, n: int, *, diagonal: bool = False
    ) -> list[tuple[int, ...]]:
        """``[(blocks, n, n)]``."""
        return [(blocks, n, n)]

    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """``a_inv`` ``(blocks, n, n)`` and ``momentum_buffer`` ``(blocks, m, n)``."""
        return {"a_inv": (blocks, a_dim, a_dim), "momentum_buffer": (blocks, g_dim, a_dim)}

    def required_keys(self, *, diagonal: Diagonal = DENSE) -> tuple[str, ...]:
        """None: a block without ``M`` is preconditioned by the identity."""
        return ()

    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float,
        diagonal: Diagonal = DENSE,
    ) -> None:
        """Stores ``M`` (``None`` keeps the previous one)."""
        if a is not None:
            state["a_inv"] = a[0]

    def stored(self, state: State, side: Side, *, diagonal: Diagonal = DENSE) -> Payload | None:
        """``[M]`` for ``A`` if stored."""
        return [state["a_inv"]] if side is Side.A and "a_inv" in state else None

    def precondition(
        self, state: State, grad: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> torch.Tensor | None:
        """``g M`` computed in ``M``'s dtype and cast to ``g``'s; ``g`` without ``M``."""
        inverse = state.get("a_inv")
        if inverse is None:
            return grad
        if grad.dim() == 3 and inverse.dim() == 3 and grad.shape[0] == inverse.shape[0]:
            return torch.bmm(grad.to(inverse.dtype), inverse).to(grad.dtype)
        return (grad.to(inverse.dtype) @ inverse).to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """``M`` and the buffer."""
        return a_dim * a_dim + g_dim * a_dim

    def decompose_flops(self, n: int, *, diagonal: bool = False) -> float:
        """Cholesky and the inverse from it: about ``n^3``."""
        return float(n) ** 3
