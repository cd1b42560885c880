"""The interface every second-order method implements (eigen, inverse, and the next ones).

A method owns everything that depends on *how* a layer's Kronecker factors are inverted:

* :meth:`SecondOrderMethod.decompose`: factors -> per-factor results ("payloads": the
  tensors a rank computes for one factor and broadcasts to the layer's gradient workers);
* :meth:`SecondOrderMethod.payload_shapes` / :attr:`SecondOrderMethod.symmetric`: the
  wire format, so receivers can allocate buffers and the communicator can send the
  symmetric ones as upper triangles;
* :meth:`SecondOrderMethod.install` / :meth:`SecondOrderMethod.stored`: turning payloads
  into the layer's stored state (and back, to resend the previous result after a failure);
* :meth:`SecondOrderMethod.precondition`: the preconditioned gradient from that state;
* :meth:`SecondOrderMethod.numel`: the memory model.

The distributed engine only moves payloads; it never looks inside them. A layer's state
is a plain ``dict[str, Tensor]`` keyed by :attr:`SecondOrderMethod.state_keys` (the
checkpoint keys).

Diagonal sides: a block may keep a factor as its diagonal ``(blocks, n)``
(:attr:`kaisa.blocks.CurvatureBlock.diagonal_sides`). Every method call that depends on
it takes it: per factor ``diagonal: bool`` (:meth:`~SecondOrderMethod.decompose`,
:meth:`~SecondOrderMethod.payload_shapes`, :meth:`~SecondOrderMethod.payload_symmetric`,
:meth:`~SecondOrderMethod.decompose_flops`), per block ``diagonal: Diagonal``, the set of
diagonal sides (the rest). A method decomposes a diagonal side in
:meth:`~SecondOrderMethod.decompose_diagonal` (elementwise, no eigenvectors) and applies it
without a rotation; the dense path is untouched when no side is diagonal.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch

from kaisa.utils.enums import Side
from kaisa.utils.finite import finite_each

logger = logging.getLogger("kaisa")

__all__ = ["DENSE", "Batch", "Damping", "Diagonal", "Payload", "SecondOrderMethod", "State"]

#: Tensors computed for one factor (e.g. ``[eigenvectors, eigenvalues]``).
Payload: TypeAlias = list[torch.Tensor]
#: A layer's stored decomposition state, keyed by :attr:`SecondOrderMethod.state_keys`.
State: TypeAlias = dict[str, torch.Tensor]
#: Damping added to one factor batch: a number, or one value per block ``(blocks,)``.
Damping: TypeAlias = float | torch.Tensor
#: The sides of a block kept as diagonals ``(blocks, n)``.
Diagonal: TypeAlias = frozenset[Side]
#: No diagonal side: both factors are ``(blocks, n, n)`` matrices.
DENSE: Diagonal = frozenset()


@dataclass(frozen=True)
class Batch:
    """Dense factor batches ``(blocks, n, n)`` decomposed in one call.

    Attributes:
        factors: The factor batches.
        damping: Per factor, what :meth:`SecondOrderMethod.factor_damping` gave for it.
        inv_dtype: Storage dtype of the results.
        names: One name per factor, for warnings.
    """

    factors: Sequence[torch.Tensor]
    damping: Sequence[Damping]
    inv_dtype: torch.dtype
    names: Sequence[str]


class SecondOrderMethod(abc.ABC):
    """How the curvature block of one layer is inverted and applied."""

    #: Keys of the layer state (also the checkpoint keys).
    state_keys: tuple[str, ...]
    #: Per payload tensor: whether it is a symmetric matrix (sent as an upper triangle
    #: when ``symmetry_aware``).
    symmetric: tuple[bool, ...]
    #: Whether :meth:`precondition` treats the leading dimension of its gradient and of
    #: every stored entry as independent blocks, so blocks of one shape can be stacked and
    #: preconditioned in one call (:mod:`kaisa.core.grouped`).
    batched: bool = False
    #: The factors the method decomposes and the engine sends: both, or ``A`` alone (a
    #: one-sided method, whose blocks record no ``G``).
    sides: tuple[Side, ...] = (Side.A, Side.G)

    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        *,
        damping: Sequence[Damping],
        inv_dtype: torch.dtype,
        names: Sequence[str],
        diagonal: Sequence[bool] | None = None,
        previous: Sequence[Payload | None] | None = None,
    ) -> list[Payload | None]:
        """Decomposes factor batches; ``None`` marks a failure.

        Dense factors ``(blocks, n, n)`` go to :meth:`decompose_dense` in one call (to
        :meth:`refresh_dense` when ``previous`` is given); diagonal ones ``(blocks, n)`` to
        :meth:`decompose_diagonal`, and a non-finite diagonal result is a failure (one host
        synchronisation for all of them).

        Args:
            factors: The running factors to decompose.
            damping: Per factor, what :meth:`factor_damping` gave for it.
            inv_dtype: Storage dtype of the results.
            names: One name per factor, for warnings.
            diagonal: Per factor, whether it is a diagonal (default: none is).
            previous: Per factor, the payload stored for it (a warm start), or ``None``.

        Returns:
            One payload (or ``None``) per factor.
        """
        flags = [False] * len(factors) if diagonal is None else list(diagonal)
        if not any(flags):
            return self._dense(Batch(factors, damping, inv_dtype, names), previous)
        out: list[Payload | None] = [None] * len(factors)
        dense = [i for i, flag in enumerate(flags) if not flag]
        if dense:
            results = self._dense(
                Batch([factors[i] for i in dense], [damping[i] for i in dense],
                           inv_dtype, [names[i] for i in dense]),
                None if previous is None else [previous[i] for i in dense],
            )
            for i, res in zip(dense, results, strict=True):
                out[i] = res
        diag = [i for i, flag in enumerate(flags) if flag]
        payloads = [self.decompose_diagonal(factors[i], damping[i], inv_dtype) for i in diag]
        each = finite_each([t for p in payloads for t in p])  # one device: the block's
        finite = torch.stack([f.all() for f in torch.split(each, [len(p) for p in payloads])])
        for i, payload, ok in zip(diag, payloads, finite.tolist(), strict=True):
            out[i] = payload if ok else None
            if not ok:
                logger.warning("the diagonal %s is not finite after damping; keeping the "
                               "previous decomposition", names[i])
        return out

    def _dense(
        self, batch: Batch, previous: Sequence[Payload | None] | None
    ) -> list[Payload | None]:
        if previous is None:
            return self.decompose_dense(batch)
        return self.refresh_dense(batch, previous)

    def refresh_dense(
        self, batch: Batch, previous: Sequence[Payload | None]
    ) -> list[Payload | None]:
        """Dense decompositions that may start from the stored ones (default: ignore them).

        Args:
            batch: The dense factors, as for :meth:`decompose_dense`.
            previous: Per factor, its stored payload or ``None``.
        """
        return self.decompose_dense(batch)

    @abc.abstractmethod
    def decompose_dense(self, batch: Batch) -> list[Payload | None]:
        """Decomposes dense factor batches (see :meth:`decompose`)."""

    @abc.abstractmethod
    def decompose_diagonal(
        self, factor: torch.Tensor, damping: Damping, inv_dtype: torch.dtype
    ) -> Payload:
        """The payload of a diagonal factor ``(blocks, n)`` (elementwise, in ``inv_dtype``)."""

    @abc.abstractmethod
    def payload_shapes(
        self, blocks: int, n: int, *, diagonal: bool = False
    ) -> list[tuple[int, ...]]:
        """Shapes of the payload tensors of a ``(blocks, n, n)`` (or diagonal) factor."""

    def payload_symmetric(self, *, diagonal: bool = False) -> tuple[bool, ...]:
        """Per payload tensor, whether it is a symmetric matrix (never for a diagonal)."""
        if not diagonal:
            return self.symmetric
        return (False,) * len(self.payload_shapes(1, 1, diagonal=True))

    @abc.abstractmethod
    def state_shapes(
        self, blocks: int, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE
    ) -> dict[str, tuple[int, ...]]:
        """The shape of each stored entry for factors of these sizes."""

    @abc.abstractmethod
    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float,
        diagonal: Diagonal = DENSE,
    ) -> None:
        """Stores new results in a layer's ``state``; ``None`` keeps the previous one."""

    @abc.abstractmethod
    def stored(self, state: State, side: Side, *, diagonal: Diagonal = DENSE) -> Payload | None:
        """The payload of the result currently stored for ``side``, if any."""

    @abc.abstractmethod
    def precondition(
        self, state: State, grad: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> torch.Tensor | None:
        """The preconditioned ``(blocks, m, n)`` gradient, or ``None`` without a result."""

    @abc.abstractmethod
    def numel(self, a_dim: int, g_dim: int, *, diagonal: Diagonal = DENSE) -> int:
        """Elements stored for one Kronecker block with factors of these sizes."""

    @abc.abstractmethod
    def decompose_flops(self, n: int, *, diagonal: bool = False) -> float:
        """Approximate floating-point operations to decompose one factor of dimension ``n``."""

    def factor_damping(
        self, a: torch.Tensor, g: torch.Tensor, damping: float, *, diagonal: Diagonal = DENSE
    ) -> tuple[Damping, Damping]:
        """The damping :meth:`decompose` gets for a layer's A and G factors.

        Args:
            a: The layer's running A factor ``(blocks, n, n)`` (``(blocks, n)`` diagonal).
            g: Its running G factor.
            damping: The current damping.
            diagonal: The block's diagonal sides.

        Returns:
            ``(damping for A, damping for G)``: numbers, or per-block tensors
            ``(blocks,)``. The default gives both the current damping.
        """
        return damping, damping

    def ready(self, state: State, *, diagonal: Diagonal = DENSE) -> bool:
        """Whether ``state`` holds what :meth:`precondition` needs."""
        return all(key in state for key in self.required_keys(diagonal=diagonal))

    def required_keys(self, *, diagonal: Diagonal = DENSE) -> tuple[str, ...]:
        """Keys that must be present before preconditioning (default: the state's)."""
        return tuple(self.state_shapes(1, 1, 1, diagonal=diagonal))
