"""The communicator of a single process: every collective is a no-op."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kaisa.distributed.protocol import CommHandle, Communicator, DoneHandle
from kaisa.distributed.stats import CommStats

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """The communicator of a single process: every operation is a no-op.

    A mean over one rank is the rank's own tensor, and a broadcast has nothing to send.
    """

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.stats = CommStats()

    def _collective(self, op: str, tensor: torch.Tensor, group: tuple[int, ...], src: int,
                    symmetric: bool, kind: str) -> CommHandle:
        """Returns ``tensor`` unchanged."""
        if group != (0,):
            raise ValueError(f"a single process has rank 0 only, got {op} group {list(group)}")
        return DoneHandle(tensor)

    def _all_to_all(self, chunks: Mapping[int, torch.Tensor], sizes: Mapping[int, int],
                    device: torch.device, kind: str) -> dict[int, torch.Tensor]:
        """Returns nothing (there is no other rank)."""
        return {}

    def flush(self) -> None:
        """Does nothing."""

    def wait_all(self) -> None:
        """Does nothing."""
