"""The communicator of a single process: every collective is a no-op."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kaisa.distributed.protocol import CommHandle, DoneHandle
from kaisa.distributed.stats import CommStats

__all__ = ["LocalCommunicator"]


class LocalCommunicator:
    """The communicator of a single process: every operation is a no-op."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.stats = CommStats()

    def allreduce_mean(
        self, tensor: torch.Tensor, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """Returns ``tensor`` unchanged (the mean over one rank)."""
        return DoneHandle(tensor)

    def reduce_mean(
        self, tensor: torch.Tensor, dst: int, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """Returns ``tensor`` unchanged (the mean over one rank, on rank 0)."""
        if dst != 0:
            raise ValueError(f"dst must be 0 in a single process, got {dst}")
        return DoneHandle(tensor)

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        group: Sequence[int],
        *,
        symmetric: bool = False,
        kind: str = "decompositions",
    ) -> CommHandle:
        """Returns ``tensor`` unchanged (nothing to send)."""
        if src != 0:
            raise ValueError(f"src must be 0 in a single process, got {src}")
        return DoneHandle(tensor)

    def exchange(
        self,
        chunks: Mapping[int, torch.Tensor],
        sizes: Mapping[int, int],
        *,
        device: torch.device,
        kind: str = "gradients",
    ) -> dict[int, torch.Tensor]:
        """Returns nothing (there is no other rank)."""
        if any(r != 0 for r in (*chunks, *sizes)):
            raise ValueError(f"a single process has no other rank, got chunks for "
                             f"{sorted(chunks)} and sizes from {sorted(sizes)}")
        return {}

    def flush(self) -> None:
        """Does nothing."""

    def wait_all(self) -> None:
        """Does nothing."""
