"""Fused, asynchronous K-FAC communication.

Two implementations of the :class:`Communicator` protocol:

* :class:`LocalCommunicator` for a single process (world size 1 or
  ``torch.distributed`` not initialised): every operation is a no-op that
  returns its input.
* :class:`TorchDistCommunicator` on top of ``torch.distributed`` (gloo or
  NCCL): small tensors are packed into flat per-dtype buckets of up to
  ``bucket_cap_mb`` megabytes, each bucket is sent with one asynchronous
  collective (``async_op=True``) and unpacked when waited on.

Bucket contract: buckets close when full or on :meth:`Communicator.flush`
(waiting on a tensor whose bucket is still open flushes all open buckets).
Every rank of a process group must therefore enqueue the same tensors (same
shapes, dtypes and ``symmetric`` flags) in the same order and flush at the same
points; the K-FAC schedule is a deterministic function of the model and the
placement, so this holds by construction.

Symmetric packing (``symmetric=True``) sends only the upper triangle of the
trailing ``n x n`` matrices (``n(n+1)/2`` of ``n^2`` elements) and mirrors it
back on receipt; batched ``(..., n, n)`` tensors are supported.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = [
    "CommHandle",
    "CommStats",
    "Communicator",
    "LocalCommunicator",
    "TorchDistCommunicator",
    "make_communicator",
    "pack_symmetric",
    "packed_numel",
    "unpack_symmetric",
]

_MB = 1024 * 1024


# ---------------------------------------------------------------------------
# Symmetric packing
# ---------------------------------------------------------------------------

_TRIU_CACHE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the upper triangle of an ``n x n`` matrix, and its mask."""
    key = (n, device)
    idx = _TRIU_CACHE.get(key)
    if idx is None:
        iu = torch.triu_indices(n, n, device=device)
        flat = iu[0] * n + iu[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_()
        idx = (flat, mask)
        _TRIU_CACHE[key] = idx
    return idx


def _check_square(shape: Sequence[int]) -> int:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"symmetric packing needs (..., n, n) tensors, got shape {tuple(shape)}")
    return int(shape[-1])


def packed_numel(shape: Sequence[int], symmetric: bool) -> int:
    """Number of elements sent for a tensor of ``shape``.

    Args:
        shape: Tensor shape.
        symmetric: Whether only the upper triangle is sent.

    Returns:
        ``prod(shape)``, or ``prod(shape[:-2]) * n(n+1)/2`` when symmetric.
    """
    if not symmetric:
        numel = 1
        for s in shape:
            numel *= int(s)
        return numel
    n = _check_square(shape)
    batch = 1
    for s in shape[:-2]:
        batch *= int(s)
    return batch * n * (n + 1) // 2


def pack_symmetric(t: torch.Tensor) -> torch.Tensor:
    """Returns the upper triangles of ``t`` (shape ``(..., n, n)``).

    Args:
        t: Symmetric matrix or batch of matrices.

    Returns:
        Tensor of shape ``(..., n(n+1)/2)``.
    """
    n = _check_square(t.shape)
    flat, _ = _triu(n, t.device)
    batch = t.shape[:-2]
    return t.reshape(-1, n * n).index_select(1, flat).reshape(*batch, flat.numel())


def unpack_symmetric(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuilds symmetric matrices from their packed upper triangles.

    Args:
        packed: Tensor of shape ``(..., n(n+1)/2)``.
        n: Matrix dimension.
        out: Optional destination of shape ``(..., n, n)``.

    Returns:
        The symmetric matrices, shape ``(..., n, n)``.
    """
    if packed.shape[-1] != n * (n + 1) // 2:
        raise ValueError(f"packed size {packed.shape[-1]} does not match n={n}")
    flat, mask = _triu(n, packed.device)
    batch = packed.shape[:-1]
    upper = packed.new_empty(int(packed[..., 0].numel()), n * n)
    upper.index_copy_(1, flat, packed.reshape(-1, flat.numel()))
    square = upper.view(*batch, n, n)
    full = torch.where(mask, square, square.transpose(-1, -2))
    if out is None:
        return full
    out.copy_(full)
    return out


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------


@dataclass
class CommStats:
    """Counters of K-FAC communication on this rank.

    Attributes:
        bytes_sent: Payload bytes handed to collectives, by kind. For an
            allreduce every rank counts the bucket size; for a broadcast only
            the source rank counts it (receivers send nothing).
        bytes_received: Broadcast payload bytes received, by kind.
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


# ---------------------------------------------------------------------------
# Handles and protocol
# ---------------------------------------------------------------------------


@runtime_checkable
class CommHandle(Protocol):
    """A pending result of :meth:`Communicator.allreduce_mean` or ``broadcast``."""

    def wait(self) -> torch.Tensor:
        """Blocks until the collective finished and returns the result."""
        ...

    def is_ready(self) -> bool:
        """Whether :meth:`wait` would return without blocking on the network."""
        ...


class _DoneHandle:
    """A handle whose result is already known."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor

    def is_ready(self) -> bool:
        return True


@runtime_checkable
class Communicator(Protocol):
    """Collective operations used by the distributed K-FAC preconditioner.

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
        ...

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
        ...

    def flush(self) -> None:
        """Launches every open bucket."""
        ...

    def wait_all(self) -> None:
        """Flushes and waits for every launched collective."""
        ...


# ---------------------------------------------------------------------------
# Local (single process)
# ---------------------------------------------------------------------------


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
        return _DoneHandle(tensor)

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
        return _DoneHandle(tensor)

    def flush(self) -> None:
        """Does nothing."""

    def wait_all(self) -> None:
        """Does nothing."""


# ---------------------------------------------------------------------------
# torch.distributed
# ---------------------------------------------------------------------------


@dataclass
class _Entry:
    tensor: torch.Tensor
    symmetric: bool
    offset: int
    numel: int
    result: torch.Tensor | None = None


class _Bucket:
    """Tensors sent together by one collective."""

    def __init__(
        self,
        comm: TorchDistCommunicator,
        op: str,
        group: tuple[int, ...],
        src: int,
        dtype: torch.dtype,
        device: torch.device,
        kind: str,
    ) -> None:
        self.comm = comm
        self.op = op
        self.group = group
        self.src = src
        self.dtype = dtype
        self.device = device
        self.kind = kind
        self.entries: list[_Entry] = []
        self.numel = 0
        self.flat: torch.Tensor | None = None
        self.work: dist.Work | None = None
        self.launched = False
        self.finished = False

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def add(self, tensor: torch.Tensor, symmetric: bool) -> int:
        numel = packed_numel(tensor.shape, symmetric)
        self.entries.append(_Entry(tensor, symmetric, self.numel, numel))
        self.numel += numel
        return len(self.entries) - 1

    def _pack(self) -> torch.Tensor:
        parts = [
            (pack_symmetric(e.tensor) if e.symmetric else e.tensor).reshape(-1)
            for e in self.entries
        ]
        if len(parts) == 1:
            return parts[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(parts)

    def launch(self) -> None:
        if self.launched:
            return
        self.launched = True
        comm = self.comm
        pg = comm._group_handle(self.group)
        if self.op == "allreduce":
            self.flat = self._pack()
            if comm._skip_allreduce:
                # Private benchmark switch: keep the local contribution (the result is
                # then NOT the average; only for measuring what the allreduce costs).
                self.flat.mul_(comm.world_size)
                return
            comm.stats.add_sent(self.kind, self.nbytes)
            self.work = dist.all_reduce(self.flat, group=pg, async_op=True)
        else:
            if comm.rank == self.src:
                self.flat = self._pack()
                comm.stats.add_sent(self.kind, self.nbytes)
            else:
                self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
                comm.stats.add_received(self.kind, self.nbytes)
            self.work = dist.broadcast(self.flat, src=self.src, group=pg, async_op=True)

    def finish(self) -> None:
        if self.finished:
            return
        if not self.launched:
            self.comm.flush()
        if self.work is not None:
            start = time.perf_counter()
            try:
                self.work.wait()
            except RuntimeError as err:
                raise RuntimeError(
                    f"K-FAC {self.op} of {self.kind} on ranks {list(self.group)} did not "
                    f"complete (a peer may have died or the process-group timeout "
                    f"{self.comm.timeout} expired): {err}"
                ) from err
            finally:
                self.comm.stats.add_wait(self.kind, time.perf_counter() - start)
            self.work = None
        flat = self.flat
        assert flat is not None
        if self.op == "allreduce":
            flat.div_(self.comm.world_size)
        for e in self.entries:
            chunk = flat[e.offset : e.offset + e.numel]
            if self.op == "allreduce":
                if e.symmetric:
                    n = int(e.tensor.shape[-1])
                    e.result = unpack_symmetric(chunk.view(*e.tensor.shape[:-2], -1), n)
                else:
                    e.result = chunk.view(e.tensor.shape)
            else:
                if self.comm.rank != self.src:
                    if e.symmetric:
                        n = int(e.tensor.shape[-1])
                        unpack_symmetric(chunk.view(*e.tensor.shape[:-2], -1), n, out=e.tensor)
                    else:
                        e.tensor.copy_(chunk.view(e.tensor.shape))
                e.result = e.tensor
            # Drop the reference to the local input (it may be large).
            if self.op == "allreduce":
                e.tensor = e.result
        if self.op != "allreduce":
            self.flat = None
        self.finished = True
        self.comm._forget(self)


class _BucketHandle:
    __slots__ = ("_bucket", "_index")

    def __init__(self, bucket: _Bucket, index: int) -> None:
        self._bucket = bucket
        self._index = index

    def wait(self) -> torch.Tensor:
        self._bucket.finish()
        result = self._bucket.entries[self._index].result
        assert result is not None
        return result

    def is_ready(self) -> bool:
        b = self._bucket
        if b.finished:
            return True
        return b.launched and (b.work is None or b.work.is_completed())


def _default_timeout() -> datetime.timedelta | None:
    try:
        pg = dist.group.WORLD
        assert pg is not None
        backend = pg._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
        return timeout if isinstance(timeout, datetime.timedelta) else None
    except (AttributeError, RuntimeError, AssertionError):
        return None


class TorchDistCommunicator:
    """Fused asynchronous collectives over ``torch.distributed``.

    K-FAC traffic uses its own world-sized process group so that it never
    interleaves with DistributedDataParallel's gradient allreduces on the
    default group. Subgroups for broadcasts are created once, at
    construction, on every rank in the same order.

    Args:
        groups: Rank sets that :meth:`broadcast` will use (gradient-worker
            and receiver groups). The full world is always available.
        bucket_cap_mb: Bucket capacity in megabytes; ``0`` disables fusion
            (one collective per tensor).
        timeout: Timeout of the K-FAC process groups; defaults to the default
            process group's timeout.
        device: Device of the communication buffers; defaults to CUDA when
            the backend is NCCL, else CPU.
    """

    def __init__(
        self,
        groups: Iterable[Sequence[int]] = (),
        bucket_cap_mb: float = 25.0,
        timeout: datetime.timedelta | None = None,
        device: torch.device | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchDistCommunicator needs an initialised torch.distributed")
        if bucket_cap_mb < 0:
            raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.stats = CommStats()
        self.bucket_cap_bytes = int(bucket_cap_mb * _MB)
        self.timeout = timeout if timeout is not None else _default_timeout()
        self.device = device
        self._skip_allreduce = False
        world = tuple(range(self.world_size))
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        # Creation order must be identical on every rank: world first, then
        # the requested groups in the given order (duplicates skipped).
        self._groups[world] = self._new_group(world)
        for ranks in groups:
            key = tuple(sorted(int(r) for r in ranks))
            if not key or key[0] < 0 or key[-1] >= self.world_size:
                raise ValueError(f"group {list(ranks)} is not a set of ranks < {self.world_size}")
            if key in self._groups:
                continue
            self._groups[key] = None if len(key) == 1 else self._new_group(key)
        self._open: dict[
            tuple[str, tuple[int, ...], int, torch.dtype, torch.device, str], _Bucket
        ] = {}
        self._pending: list[_Bucket] = []

    def _new_group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        kwargs = {} if self.timeout is None else {"timeout": self.timeout}
        pg: dist.ProcessGroup | None = dist.new_group(ranks=list(ranks), **kwargs)  # type: ignore[arg-type]
        assert pg is not None
        return pg

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Registered rank sets."""
        return list(self._groups)

    def _group_handle(self, group: tuple[int, ...]) -> dist.ProcessGroup | None:
        try:
            return self._groups[group]
        except KeyError:
            raise ValueError(
                f"group {list(group)} was not registered at construction (known: {self.groups})"
            ) from None

    def _forget(self, bucket: _Bucket) -> None:
        with contextlib.suppress(ValueError):
            self._pending.remove(bucket)

    def _enqueue(
        self,
        op: str,
        tensor: torch.Tensor,
        group: tuple[int, ...],
        src: int,
        symmetric: bool,
        kind: str,
    ) -> CommHandle:
        key = (op, group, src, tensor.dtype, tensor.device, kind)
        numel = packed_numel(tensor.shape, symmetric)
        nbytes = numel * tensor.element_size()
        bucket = self._open.get(key)
        if bucket is not None and bucket.nbytes + nbytes > self.bucket_cap_bytes:
            del self._open[key]
            bucket.launch()
            bucket = None
        if bucket is None:
            bucket = _Bucket(self, op, group, src, tensor.dtype, tensor.device, kind)
            self._pending.append(bucket)
            self._open[key] = bucket
        index = bucket.add(tensor, symmetric)
        if bucket.nbytes >= self.bucket_cap_bytes:
            del self._open[key]
            bucket.launch()
        return _BucketHandle(bucket, index)

    def allreduce_mean(
        self, tensor: torch.Tensor, *, symmetric: bool = False, kind: str = "factors"
    ) -> CommHandle:
        """See :meth:`Communicator.allreduce_mean`."""
        world = tuple(range(self.world_size))
        return self._enqueue("allreduce", tensor, world, -1, symmetric, kind)

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        group: Sequence[int],
        *,
        symmetric: bool = False,
        kind: str = "decompositions",
    ) -> CommHandle:
        """See :meth:`Communicator.broadcast`."""
        key = tuple(sorted(int(r) for r in group))
        if src not in key:
            raise ValueError(f"broadcast source {src} is not in group {list(group)}")
        self._group_handle(key)
        if self.rank not in key or len(key) == 1:
            return _DoneHandle(tensor)
        return self._enqueue("broadcast", tensor, key, src, symmetric, kind)

    def flush(self) -> None:
        """Launches every open bucket, in creation order."""
        open_buckets = [b for b in self._pending if not b.launched]
        self._open.clear()
        for bucket in open_buckets:
            bucket.launch()

    def wait_all(self) -> None:
        """Flushes and waits for every outstanding collective."""
        self.flush()
        for bucket in list(self._pending):
            bucket.finish()


def make_communicator(
    groups: Iterable[Sequence[int]] = (),
    bucket_cap_mb: float = 25.0,
    timeout: datetime.timedelta | None = None,
) -> LocalCommunicator | TorchDistCommunicator:
    """Chooses the communicator for the current process.

    Args:
        groups: Broadcast groups to register (see
            :class:`TorchDistCommunicator`).
        bucket_cap_mb: Fusion bucket capacity (``0`` disables fusion).
        timeout: Process-group timeout for K-FAC collectives.

    Returns:
        A :class:`TorchDistCommunicator` when ``torch.distributed`` is
        initialised with more than one rank, else a :class:`LocalCommunicator`.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistCommunicator(groups, bucket_cap_mb=bucket_cap_mb, timeout=timeout)
    return LocalCommunicator()
