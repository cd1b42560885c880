"""The collective operations the K-FAC engine uses, as an abstract base class.

:class:`Communicator`'s public methods state the contract and check their arguments once;
an implementation starts the checked collectives (:meth:`Communicator._collective`,
:meth:`Communicator._all_to_all`). Two implementations:
:class:`~kaisa.distributed.local.LocalCommunicator` (one process) and
:class:`~kaisa.distributed.torch_comm.TorchDistCommunicator` (``torch.distributed``, fused
asynchronous buckets). Tests' fakes provide the same public methods.

Bucket contract: buckets close when full or on :meth:`Communicator.flush` (waiting on a
tensor whose bucket is still open flushes all open buckets). Every rank of a process
group must therefore enqueue the same tensors (same shapes, dtypes and ``symmetric``
flags) in the same order and flush at the same points; the K-FAC schedule is a
deterministic function of the model and the placement, so this holds by construction.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from kaisa.distributed.stats import CommStats

__all__ = ["IN_PLACE_BUCKETS_IN_FLIGHT", "CommHandle", "Communicator", "DoneHandle"]

#: Buckets of in-place allreduces (:meth:`Communicator.allreduce_mean_`) and of reduces
#: (:meth:`Communicator.reduce_mean`) in flight at once: their copies are what the factors'
#: averaging holds beyond the factors during the backward pass.
IN_PLACE_BUCKETS_IN_FLIGHT = 2


@runtime_checkable
class CommHandle(Protocol):
    """A pending result of :meth:`Communicator.allreduce_mean` or ``broadcast``."""

    def wait(self) -> torch.Tensor:
        """Blocks until the collective finished and returns the result."""
        ...

    @property
    def done(self) -> bool:
        """Whether the result is there: :meth:`wait` returns it without blocking."""
        ...


class DoneHandle:
    """A handle whose result is already known."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        """Returns the known result."""
        return self._tensor

    @property
    def done(self) -> bool:
        """Always: the result is known."""
        return True


class Communicator(abc.ABC):
    """Collective operations used by the distributed K-FAC preconditioner.

    The public methods check their arguments and hand each collective to the
    implementation's :meth:`_collective` (or :meth:`_all_to_all`).

    Attributes:
        rank: This process's rank.
        world_size: Number of processes.
        stats: Communication counters of this rank.
    """

    rank: int
    world_size: int
    stats: CommStats

    def allreduce_mean(
        self, tensor: torch.Tensor, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """Averages ``tensor`` over all ranks (asynchronously, fused).

        Args:
            tensor: Local contribution; it must not be modified before the
                handle is waited on.
            symmetric: Send only the upper triangle of the ``(..., n, n)``
                tensor and rebuild it on receipt.
            kind: Counter key for :attr:`stats`.

        Returns:
            A handle whose ``wait()`` returns the average (a new tensor).
        """
        world = tuple(range(self.world_size))
        return self._collective("allreduce", tensor, world, -1, symmetric, kind)

    def allreduce_mean_(
        self, tensor: torch.Tensor, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """Averages ``tensor`` over all ranks in place (asynchronously, fused).

        The average is written into ``tensor`` itself when the collective is waited on. A
        tensor alone in its bucket (larger than the bucket capacity), contiguous and sent
        whole, is reduced where it is, with no copy; the others travel in a bucket copy
        that lives until the collective is waited on. At most
        :data:`IN_PLACE_BUCKETS_IN_FLIGHT` such buckets are in flight: launching another
        first waits for the oldest (on a GPU a stream dependency, not a host wait).

        Args:
            tensor: Local contribution and destination; it must not be read or modified
                before the handle is waited on.
            symmetric: Send only the upper triangle of the ``(..., n, n)`` tensor (the
                lower one is rebuilt from it).
            kind: Counter key for :attr:`stats`.

        Returns:
            A handle whose ``wait()`` returns ``tensor``, now the average.
        """
        world = tuple(range(self.world_size))
        return self._collective("allreduce_", tensor, world, -1, symmetric, kind)

    def reduce_mean(
        self, tensor: torch.Tensor, dst: int, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """Averages ``tensor`` over all ranks onto rank ``dst`` only (asynchronously, fused).

        Every rank contributes; buckets are grouped by destination. At most
        :data:`IN_PLACE_BUCKETS_IN_FLIGHT` of them (with the in-place allreduces) are in
        flight: launching another first waits for the oldest.

        Args:
            tensor: Local contribution; it must not be modified before the
                handle is waited on.
            dst: The rank that receives the average.
            symmetric: Send only the upper triangle of the ``(..., n, n)`` tensor.
            kind: Counter key for :attr:`stats`.

        Returns:
            A handle whose ``wait()`` returns the average on ``dst`` (a new tensor) and an
            empty tensor elsewhere (the input is not kept once sent).
        """
        if not 0 <= dst < self.world_size:
            raise ValueError(f"reduce destination {dst} is not a rank < {self.world_size}")
        world = tuple(range(self.world_size))
        return self._collective("reduce", tensor, world, dst, symmetric, kind)

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        group: Sequence[int],
        *,
        symmetric: bool = False,
        kind: str = "decompositions",
    ) -> CommHandle:
        """Broadcasts ``tensor`` from ``src`` to the ranks of ``group``.

        On ``src`` the tensor is the data; on the other members it is the
        destination, overwritten in place when the handle is waited on. Ranks
        outside ``group`` get a completed handle and send nothing.

        Args:
            tensor: Data (source) or destination buffer (receivers).
            src: Global rank of the source; must be in ``group``.
            group: Global ranks taking part (a group registered at
                construction for :class:`TorchDistCommunicator`).
            symmetric: Send only upper triangles.
            kind: Counter key for :attr:`stats`.

        Returns:
            A handle whose ``wait()`` returns ``tensor`` filled with the data.
        """
        key = tuple(sorted(int(r) for r in group))
        if src not in key:
            raise ValueError(f"broadcast source {src} is not in group {list(group)}")
        return self._collective("broadcast", tensor, key, src, symmetric, kind)

    def exchange(
        self,
        chunks: Mapping[int, torch.Tensor],
        sizes: Mapping[int, int],
        *,
        device: torch.device,
        kind: str = "gradients",
    ) -> dict[int, torch.Tensor]:
        """Sends each rank its own bytes and receives each rank's (blocking, all ranks).

        An all-to-all with a chunk per pair of ranks (most may be empty): every rank
        calls it at the same point, also with nothing to send or receive. Nothing goes
        through the buckets.

        Args:
            chunks: ``destination rank -> 1-d uint8 tensor`` (other ranks only).
            sizes: ``source rank -> bytes`` this rank receives from it (other ranks only;
                the source's chunk for this rank has that size).
            device: Where the buffers live (CUDA for NCCL).
            kind: Counter key for :attr:`stats`.

        Returns:
            ``source rank -> 1-d uint8 tensor`` for every source with a size above 0,
            views of one buffer at offsets in rank order.
        """
        world = range(self.world_size)
        if self.rank in chunks or self.rank in sizes or any(
                r not in world for r in (*chunks, *sizes)):
            raise ValueError(f"exchange takes other ranks of {self.world_size}, got chunks "
                             f"for {sorted(chunks)} and sizes from {sorted(sizes)}")
        return self._all_to_all(chunks, sizes, device, kind)

    @abc.abstractmethod
    def flush(self) -> None:
        """Launches every open bucket."""

    @abc.abstractmethod
    def wait_all(self) -> None:
        """Flushes and waits for every launched collective."""

    @abc.abstractmethod
    def _collective(self, op: str, tensor: torch.Tensor, group: tuple[int, ...], src: int,
                    symmetric: bool, kind: str) -> CommHandle:
        """Starts a checked collective.

        Args:
            op: ``'allreduce'``, ``'allreduce_'`` (in place), ``'reduce'`` or ``'broadcast'``.
            tensor: As the public method's.
            group: The sorted ranks taking part (every rank but for a broadcast).
            src: The reduce's destination or the broadcast's source; -1 for an allreduce.
            symmetric: As the public method's.
            kind: As the public method's.
        """

    @abc.abstractmethod
    def _all_to_all(self, chunks: Mapping[int, torch.Tensor], sizes: Mapping[int, int],
                    device: torch.device, kind: str) -> dict[int, torch.Tensor]:
        """:meth:`exchange` with its ranks checked (all other ranks of the world)."""
