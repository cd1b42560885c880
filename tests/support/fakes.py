"""A scripted communicator: one rank of a pretended world, for engine unit tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kaisa.distributed import CommStats
from kaisa.distributed.protocol import CommHandle, DoneHandle


@dataclass
class Call:
    """One collective the engine asked for."""

    op: str
    shape: tuple[int, ...]
    src: int | None
    group: tuple[int, ...]
    symmetric: bool
    kind: str


@dataclass
class FakeCommunicator:
    """Stands in for a :class:`kaisa.distributed.Communicator` as ``rank`` of ``world_size``.

    ``allreduce_mean`` returns the local contribution (as if every rank sent the same).
    A ``broadcast`` this rank receives is filled by ``peer(call, buffer)``; the default
    fills it with the source rank's number. Every call is recorded in ``calls``.
    """

    rank: int
    world_size: int
    peer: Callable[[Call, torch.Tensor], None] | None = None
    stats: CommStats = field(default_factory=CommStats)
    calls: list[Call] = field(default_factory=list)
    flushes: int = 0

    def allreduce_mean(
        self, tensor: torch.Tensor, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        self.calls.append(Call("allreduce", tuple(tensor.shape), None,
                               tuple(range(self.world_size)), symmetric, kind))
        return DoneHandle(tensor.clone())

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        group: Sequence[int],
        *,
        symmetric: bool = False,
        kind: str = "decompositions",
    ) -> CommHandle:
        call = Call("broadcast", tuple(tensor.shape), src, tuple(sorted(group)), symmetric, kind)
        self.calls.append(call)
        if src != self.rank and self.rank in group:
            if self.peer is None:
                tensor.fill_(float(src))
            else:
                self.peer(call, tensor)
        return DoneHandle(tensor)

    def exchange(
        self,
        chunks: Mapping[int, torch.Tensor],
        sizes: Mapping[int, int],
        *,
        device: torch.device,
        kind: str = "gradients",
    ) -> dict[int, torch.Tensor]:
        """Records the all-to-all; what arrives is zero bytes of the asked sizes."""
        sent = sum(int(c.numel()) for c in chunks.values())
        self.calls.append(Call("exchange", (sent,), None, tuple(range(self.world_size)),
                               False, kind))
        return {src: torch.zeros(n, dtype=torch.uint8, device=device)
                for src, n in sizes.items() if n}

    def flush(self) -> None:
        self.flushes += 1

    def wait_all(self) -> None:
        self.flushes += 1

    def sent(self, kind: str) -> list[Call]:
        """The broadcasts this rank sourced, of ``kind``."""
        return [c for c in self.calls if c.op == "broadcast" and c.src == self.rank
                and c.kind == kind and len(c.group) > 1]
