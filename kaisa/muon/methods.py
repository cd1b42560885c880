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

__all__ = ["InputMuonMethod", "input_inverse", "input_parts"]


def input_parts(n: int, max_dim: int | None) -> int:
    """The diagonal blocks ``p`` of an ``n``-wide input.

    The fewest ``p`` dividing ``n`` with ``n / p <= max_dim`` (1 for ``max_dim=None`` or
    ``n <= max_dim``).
    """
    if max_dim is None or n <= max_dim:
        return 1
    return next(p for p in range(-(-n // max_dim), n + 1) if n % p == 0)


def input_inverse(
    a: torch.Tensor, ridge: float, inv_dtype: torch.dtype, name: str = "A", parts: int = 1
) -> torch.Tensor:
    """``M = (B / k + ridge I)^-1`` per block of ``a`` ``(blocks, n, n)``, ``k = mean(diag A)``.

    ``B`` is ``A`` (``parts=1``) or its block diagonal of ``parts`` equal blocks, whose
    inverses are returned. Blocks whose ``k`` is not finite and positive, or whose inverse
    fails even in float64, get the identity.

    Returns:
        ``(blocks, parts, n / parts, n / parts)`` in ``inv_dtype``.
    """
    blocks, n = a.shape[0], a.shape[-1]
    d = n // parts
    k = a.diagonal(dim1=-2, dim2=-1).mean(-1)
    usable = torch.isfinite(k) & (k > 0)
    scale = torch.where(usable, k, torch.ones_like(k))
    if parts > 1:  # the diagonal blocks, (blocks * parts, d, d)
        a = a.reshape(blocks, parts, d, parts, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)
        scale = scale.repeat_interleave(parts)
        usable = usable.repeat_interleave(parts)
    a = a.reshape(blocks * parts, d, d)
    inverse = linalg.damped_inverses([a / scale[:, None, None]], damping=ridge,
                                     inv_dtype=inv_dtype, names=[name])[0]
    eye = torch.eye(d, dtype=inv_dtype, device=a.device).expand_as(a)
    out = eye.clone() if inverse is None else torch.where(usable[:, None, None], inverse, eye)
    return out.reshape(blocks, parts, d, d)


class InputMuonMethod(SecondOrderMethod):
    """``a_inv`` and ``momentum_buffer`` per block; preconditioning is ``g @ a_inv``."""

    state_keys = ("a_inv", "momentum_buffer")
    symmetric = (True,)
    batched = True
    sides = (Side.A,)

    def __init__(self, ridge: float, max_input_dim: int | None = None) -> None:
        self.ridge = ridge
        self.max_input_dim = max_input_dim

    def decompose_dense(self, batch: Batch) -> list[Payload | None]:
        """``[M]`` of each A batch (:func:`input_inverse`; the damping is the ridge's)."""
        return [[input_inverse(f, self.ridge, batch.inv_dtype, name,
                               input_parts(f.shape[-1], self.max_input_dim))]
                for f, name in zip(batch.factors, batch.names, strict=True)]

    def decompose_diagonal(
        self, factor: torch.Tensor, damping: Damping, inv_dtype: torch.dtype
    ) -> Payload:
        """Not used: KFACMuon's blocks are dense and one-sided."""
        raise NotImplementedError("KFACMuon's input curvature has no diagonal side")

    def payload_shapes(
        self, blocks: int, n: int, *, diagonal: bool = False
    ) -> list[tuple[int, ...]]:
        """``[(blocks, parts, n / parts, n / parts)]``."""
        parts = input_parts(n, self.max_input_dim)
        return [(blocks, parts, n // parts, n // parts)]

    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """``a_inv`` ``(blocks, parts, n / parts, n / parts)``, the buffer ``(blocks, m, n)``."""
        parts = input_parts(a_dim, self.max_input_dim)
        d = a_dim // parts
        return {"a_inv": (blocks, parts, d, d), "momentum_buffer": (blocks, g_dim, a_dim)}

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
        """``g M`` computed in ``M``'s dtype and cast to ``g``'s; ``g`` without ``M``.

        A block-diagonal ``M`` multiplies each column group of ``g`` by its block.
        """
        inverse = state.get("a_inv")
        if inverse is None:
            return grad
        blocks, parts, d = inverse.shape[0], inverse.shape[1], inverse.shape[-1]
        g = grad.to(inverse.dtype)
        if parts == 1:
            return torch.bmm(g, inverse[:, 0]).to(grad.dtype)
        m = g.shape[-2]
        cols = g.reshape(blocks, m, parts, d).transpose(1, 2).reshape(blocks * parts, m, d)
        out = torch.bmm(cols, inverse.reshape(blocks * parts, d, d))
        return out.reshape(blocks, parts, m, d).transpose(1, 2).reshape(g.shape).to(grad.dtype)

    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """``M`` (its blocks) and the buffer."""
        return a_dim * a_dim // input_parts(a_dim, self.max_input_dim) + g_dim * a_dim

    def decompose_flops(self, n: int, *, diagonal: bool = False) -> float:
        """Cholesky and the inverse from it: about ``n^3``."""
        return float(n) ** 3
