"""Fused, asynchronous K-FAC collectives on ``torch.distributed`` (gloo or NCCL).

Small tensors are packed into flat per-dtype buckets of up to ``bucket_cap_mb``
megabytes; each bucket is sent with one asynchronous collective (``async_op=True``) and
unpacked when waited on. K-FAC traffic uses its own process groups so it never
interleaves with DistributedDataParallel's gradient allreduces. See
:mod:`kaisa.distributed.protocol` for the contract.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kaisa.distributed.local import LocalCommunicator
from kaisa.distributed.protocol import (
    IN_PLACE_BUCKETS_IN_FLIGHT,
    CommHandle,
    Communicator,
    DoneHandle,
)
from kaisa.distributed.stats import CommStats
from kaisa.utils.packing import pack_symmetric, packed_numel, unpack_symmetric

__all__ = ["TorchDistCommunicator", "make_communicator"]

_MB = 1024 * 1024


@dataclass
class _Entry:
    #: The input: ``None`` once an allreduce or a reduce has packed it (released, so a
    #: batch factor in flight is held once, in the bucket).
    tensor: torch.Tensor | None
    symmetric: bool
    offset: int
    numel: int
    shape: torch.Size
    result: torch.Tensor | None = None


@dataclass(eq=False)
class _Bucket:
    """Tensors sent together by one collective (compared by identity)."""

    comm: TorchDistCommunicator
    op: str
    group: tuple[int, ...]
    src: int
    dtype: torch.dtype
    device: torch.device
    kind: str
    entries: list[_Entry] = field(default_factory=list)
    numel: int = 0
    flat: torch.Tensor | None = None
    work: dist.Work | None = None
    launched: bool = False
    finished: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def add(self, tensor: torch.Tensor, symmetric: bool) -> int:
        numel = packed_numel(tensor.shape, symmetric)
        self.entries.append(_Entry(tensor, symmetric, self.numel, numel, tensor.shape))
        self.numel += numel
        return len(self.entries) - 1

    def _pack(self, release: bool = False) -> torch.Tensor:
        """The entries in one flat buffer; with ``release`` the inputs are let go."""
        parts = []
        for e in self.entries:
            assert e.tensor is not None  # packed once, at launch
            parts.append((pack_symmetric(e.tensor) if e.symmetric else e.tensor).reshape(-1))
        flat = (parts[0].clone(memory_format=torch.contiguous_format) if len(parts) == 1
                else torch.cat(parts))
        if release:
            for e in self.entries:
                e.tensor = None
        return flat

    def _view(self) -> torch.Tensor | None:
        """The one entry itself, flat, when it can be sent where it is (no copy)."""
        if len(self.entries) != 1:
            return None
        e = self.entries[0]
        t = e.tensor
        if t is None or e.symmetric or not t.is_contiguous():
            return None
        return t.view(-1)

    def launch(self) -> None:
        if self.launched:
            return
        self.launched = True
        comm = self.comm
        pg = comm._group_handle(self.group)
        if self.op == "allreduce":
            self.flat = self._pack(release=True)
            comm.stats.add_sent(self.kind, self.nbytes)
            self.work = dist.all_reduce(self.flat, group=pg, async_op=True)
        elif self.op == "allreduce_":  # in place: the entries stay, results written back
            comm._in_flight(self)
            view = self._view()
            self.flat = view if view is not None else self._pack()
            comm.stats.add_sent(self.kind, self.nbytes)
            self.work = dist.all_reduce(self.flat, group=pg, async_op=True)
        elif self.op == "reduce":  # src: the destination
            comm._in_flight(self)  # the contributions' copies: two buckets at most
            self.flat = self._pack(release=True)
            comm.stats.add_sent(self.kind, self.nbytes)
            self.work = dist.reduce(self.flat, dst=self.src, group=pg, async_op=True)
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
        # A reduce's sum arrives on its destination only; elsewhere an entry's result is
        # empty (its input was released when sent; the engine drops it).
        reduced = self.op in ("allreduce", "allreduce_") or (
            self.op == "reduce" and self.comm.rank == self.src)
        if reduced:
            flat.div_(self.comm.world_size)
        for e in self.entries:
            chunk = flat[e.offset : e.offset + e.numel]
            if self.op in ("allreduce_", "broadcast"):  # the result goes into the input
                assert e.tensor is not None
                copied = (chunk.data_ptr() != e.tensor.data_ptr() if self.op == "allreduce_"
                          else self.comm.rank != self.src)  # else: the input is the result
                if copied:
                    _unpack(chunk, e, out=e.tensor)
                e.result = e.tensor
            elif self.op == "reduce" and not reduced:
                e.result = flat.new_empty(0)
            else:
                e.result = _unpack(chunk, e)
        if self.op != "allreduce":  # an allreduce's results are views of its flat buffer
            self.flat = None
        self.finished = True
        self.comm._forget(self)


def _unpack(chunk: torch.Tensor, e: _Entry, out: torch.Tensor | None = None) -> torch.Tensor:
    """Entry ``e``'s part of a bucket, in its shape.

    Into ``out`` if given; else a new tensor (symmetric) or a view of the bucket.
    """
    if e.symmetric:
        return unpack_symmetric(chunk.view(*e.shape[:-2], -1), int(e.shape[-1]), out=out)
    if out is None:
        return chunk.view(e.shape)
    return out.copy_(chunk.view(e.shape))


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

    @property
    def done(self) -> bool:
        return self._bucket.finished


def _default_timeout() -> datetime.timedelta | None:
    try:
        pg = dist.group.WORLD
        assert pg is not None
        backend = pg._get_backend(torch.device("cpu"))
        timeout = backend.options._timeout
        return timeout if isinstance(timeout, datetime.timedelta) else None
    except (AttributeError, RuntimeError, AssertionError):
        return None


class TorchDistCommunicator(Communicator):
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
        # In-place allreduce and reduce buckets launched and not finished, oldest first.
        self._in_place: list[_Bucket] = []

    def _in_flight(self, bucket: _Bucket) -> None:
        """Registers a launched bucket whose copies are capped, finishing the oldest first."""
        while len(self._in_place) >= IN_PLACE_BUCKETS_IN_FLIGHT:
            self._in_place.pop(0).finish()
        self._in_place.append(bucket)

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
        """Lets go of a finished bucket (its results live as long as their users keep them)."""
        with contextlib.suppress(ValueError):
            self._pending.remove(bucket)
        with contextlib.suppress(ValueError):
            self._in_place.remove(bucket)

    def _collective(self, op: str, tensor: torch.Tensor, group: tuple[int, ...], src: int,
                    symmetric: bool, kind: str) -> CommHandle:
        """Adds ``tensor`` to the open bucket of its collective (launched when full)."""
        if op == "broadcast":
            self._group_handle(group)  # registered at construction
            if self.rank not in group or len(group) == 1:
                return DoneHandle(tensor)
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

    def _all_to_all(self, chunks: Mapping[int, torch.Tensor], sizes: Mapping[int, int],
                    device: torch.device, kind: str) -> dict[int, torch.Tensor]:
        """``all_to_all_single`` with uneven splits, on the K-FAC world group."""
        world = range(self.world_size)
        send_sizes = [int(chunks[r].numel()) if r in chunks else 0 for r in world]
        recv_sizes = [int(sizes.get(r, 0)) for r in world]
        empty = torch.empty(0, dtype=torch.uint8, device=device)
        send = torch.cat([chunks[r] for r in world if r in chunks] or [empty])
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        self.stats.add_exchange(kind, sum(send_sizes), sum(recv_sizes))
        pg = self._group_handle(tuple(world))
        work = dist.all_to_all_single(out, send, recv_sizes, send_sizes, group=pg,
                                      async_op=True)
        start = time.perf_counter()
        try:
            assert work is not None
            work.wait()
        except RuntimeError as err:
            raise RuntimeError(
                f"K-FAC all-to-all of {kind} on ranks {list(world)} did not complete (a peer "
                f"may have died or the process-group timeout {self.timeout} expired): {err}"
            ) from err
        finally:
            self.stats.add_wait(kind, time.perf_counter() - start)
        received, offset = {}, 0
        for r, n in enumerate(recv_sizes):
            if n:
                received[r] = out[offset : offset + n]
            offset += n
        return received

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
