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
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TypeAlias

import torch

from kaisa.enums import Side

__all__ = ["Damping", "Payload", "SecondOrderMethod", "State"]

#: Tensors computed for one factor (e.g. ``[eigenvectors, eigenvalues]``).
Payload: TypeAlias = list[torch.Tensor]
#: A layer's stored decomposition state, keyed by :attr:`SecondOrderMethod.state_keys`.
State: TypeAlias = dict[str, torch.Tensor]
#: Damping added to one factor batch: a number, or one value per block ``(blocks,)``.
Damping: TypeAlias = float | torch.Tensor


class SecondOrderMethod(abc.ABC):
    """How the curvature block of one layer is inverted and applied."""

    #: Keys of the layer state (also the checkpoint keys).
    state_keys: tuple[str, ...]
    #: Per payload tensor: whether it is a symmetric matrix (sent as an upper triangle
    #: when ``symmetry_aware``).
    symmetric: tuple[bool, ...]

    @abc.abstractmethod
    def decompose(
        self,
        factors: Sequence[torch.Tensor],
        *,
        damping: Sequence[Damping],
        inv_dtype: torch.dtype,
        names: Sequence[str],
    ) -> list[Payload | None]:
        """Decomposes factor batches ``(blocks, n, n)``; ``None`` marks a failure.

        Args:
            factors: The running factors to decompose.
            damping: Per factor, what :meth:`factor_damping` gave for it.
            inv_dtype: Storage dtype of the results.
            names: One name per factor, for warnings.

        Returns:
            One payload (or ``None``) per factor.
        """

    @abc.abstractmethod
    def payload_shapes(self, blocks: int, n: int) -> list[tuple[int, ...]]:
        """Shapes of the payload tensors of a ``(blocks, n, n)`` factor."""

    @abc.abstractmethod
    def state_shapes(self, blocks: int, a_dim: int, g_dim: int) -> dict[str, tuple[int, ...]]:
        """The shape of each :attr:`state_keys` entry for factors of these sizes."""

    @abc.abstractmethod
    def install(
        self, state: State, a: Payload | None, g: Payload | None, *, damping: float
    ) -> None:
        """Stores new results in a layer's ``state``; ``None`` keeps the previous one."""

    @abc.abstractmethod
    def stored(self, state: State, side: Side) -> Payload | None:
        """The payload of the result currently stored for ``side``, if any."""

    @abc.abstractmethod
    def precondition(
        self, state: State, grad: torch.Tensor, damping: float
    ) -> torch.Tensor | None:
        """The preconditioned ``(blocks, m, n)`` gradient, or ``None`` without a result."""

    @abc.abstractmethod
    def numel(self, a_dim: int, g_dim: int) -> int:
        """Elements stored for one Kronecker block with factors of these sizes."""

    @abc.abstractmethod
    def decompose_flops(self, n: int) -> float:
        """Approximate floating-point operations to decompose one ``n x n`` factor."""

    def factor_damping(
        self, a: torch.Tensor, g: torch.Tensor, damping: float
    ) -> tuple[Damping, Damping]:
        """The damping :meth:`decompose` gets for a layer's A and G factors.

        Args:
            a: The layer's running A factor ``(blocks, n, n)``.
            g: Its running G factor.
            damping: The current damping.

        Returns:
            ``(damping for A, damping for G)``: numbers, or per-block tensors
            ``(blocks,)``. The default gives both the current damping.
        """
        return damping, damping

    def ready(self, state: State) -> bool:
        """Whether ``state`` holds what :meth:`precondition` needs."""
        return all(key in state for key in self.required_keys())

    def required_keys(self) -> tuple[str, ...]:
        """Keys that must be present before preconditioning (default: all)."""
        return self.state_keys
