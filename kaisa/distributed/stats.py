"""Counters of K-FAC communication (bytes, calls, time waited) on one rank."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommStats"]


@dataclass
class CommStats:
    """Counters of K-FAC communication on this rank.

    Attributes:
        bytes_sent: Payload bytes handed to collectives, by kind. For an
            allreduce every rank counts the bucket size; for a broadcast only
            the source rank counts it (receivers send nothing); for an all-to-all,
            what this rank sends to the other ranks.
        bytes_received: Broadcast payload bytes received, by kind (and the bytes an
            all-to-all brings from other ranks).
        calls: Number of collectives launched, by kind.
        wait_seconds: Wall time spent blocked in ``wait()``, by kind.
    """

    bytes_sent: dict[str, int] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    wait_seconds: dict[str, float] = field(default_factory=dict)

    def add_sent(self, kind: str, nbytes: int) -> None:
        """Records ``nbytes`` sent in one collective of ``kind``."""
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add_received(self, kind: str, nbytes: int) -> None:
        """Records ``nbytes`` received in one broadcast of ``kind``."""
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add_exchange(self, kind: str, sent: int, received: int) -> None:
        """Records one all-to-all of ``kind``: bytes sent to and received from other ranks."""
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + sent
        self.bytes_received[kind] = self.bytes_received.get(kind, 0) + received
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def add_wait(self, kind: str, seconds: float) -> None:
        """Records time blocked waiting on a collective of ``kind``."""
        self.wait_seconds[kind] = self.wait_seconds.get(kind, 0.0) + seconds

    def reset(self) -> None:
        """Zeroes every counter."""
        self.bytes_sent.clear()
        self.bytes_received.clear()
        self.calls.clear()
        self.wait_seconds.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        """A JSON-friendly copy of the counters."""
        return {
            "bytes_sent": {k: float(v) for k, v in self.bytes_sent.items()},
            "bytes_received": {k: float(v) for k, v in self.bytes_received.items()},
            "calls": {k: float(v) for k, v in self.calls.items()},
            "wait_seconds": dict(self.wait_seconds),
        }
