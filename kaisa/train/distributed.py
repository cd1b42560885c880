"""torchrun integration: process-group setup, the DDP wrapper and rank helpers."""

from __future__ import annotations

import datetime
import errno
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]
from torch.distributed.rendezvous import rendezvous
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DistContext:
    """Where this process runs: its rank, the world size and its device."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def enabled(self) -> bool:
        """Whether a process group is initialised (launched by torchrun)."""
        return self.world_size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        """Whether this process logs, prints and writes files."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """Whether ``RANK`` and ``WORLD_SIZE`` are set in the environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def setup(device: str = "auto", *, timeout_s: float | None = None) -> DistContext:
    """Initialise the process group under torchrun; no-op for a single process.

    Args:
        device: ``auto`` (cuda when available), ``cpu`` or ``cuda``.
        timeout_s: Process-group timeout in seconds (``None``: torch's default).

    Returns:
        The context for this process. Uses gloo on CPU and nccl on CUDA.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if not launched_by_torchrun():
        return DistContext(device=torch.device("cuda" if use_cuda else "cpu"))
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if not dist.is_initialized():
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", rank=rank, world_size=world_size, timeout=timeout,
            store=_attempt_store(rank, world_size, timeout),
        )
    return DistContext(rank=rank, world_size=world_size, device=target)


def _attempt_store(rank: int, world_size: int,
                   timeout: datetime.timedelta | None) -> Store:
    """The store of torchrun, its keys prefixed with the restart count (``--max-restarts``).

    A restarted group reuses the agent's store, in which the previous attempt's process
    group left its keys (each rank's address): without a prefix per attempt, gloo's new
    ranks read those and fail to connect ("Connection refused"), or wait forever.
    """
    store, _, _ = next(rendezvous(
        "env://", rank=rank, world_size=world_size,
        **({} if timeout is None else {"timeout": timeout})))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"kaisa/attempt_{attempt}/", store)


def teardown(context: DistContext, *, wait: bool = True) -> None:
    """Destroy the process group; with ``wait``, first let every rank finish (rank 0 writes)."""
    if context.enabled and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor, context: DistContext) -> torch.Tensor:
    """Sum ``values`` over all processes (identity for a single process)."""
    if context.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class PeerWriteError(OSError):
    """Raised on the ranks that did not fail when another rank's write failed."""


def raise_together(failure: OSError | None, context: DistContext, path: Path) -> None:
    """Every rank learns whether a rank's write failed, and raises (one all-reduce).

    Rank 0 alone writes the run's files; without this, a full disk stops it while the
    other ranks wait for it in their next collective and die of the lost connection.

    Raises:
        OSError: ``failure`` on the rank that had it, one naming ``path`` on the others.
    """
    flag = all_reduce_sum(torch.tensor([float(failure is not None)], dtype=torch.float64),
                          context)
    if failure is not None:
        raise failure
    if flag[0] > 0:
        raise PeerWriteError(errno.EIO, "another rank could not write it (see rank 0)", str(path))


def all_gather_rows(values: torch.Tensor, context: DistContext) -> torch.Tensor:
    """Every rank's ``values`` (a 1-D CPU tensor) as the rows of one ``(world, n)`` tensor."""
    if not context.enabled:
        return values.unsqueeze(0).clone()
    parts = [torch.empty_like(values, device=context.device) for _ in range(context.world_size)]
    dist.all_gather(parts, values.to(context.device))
    return torch.stack(parts).cpu()


class OrderedAllreduce:
    """A DDP communication hook whose sums do not depend on DDP's bucket layout.

    DDP lays its gradient buckets out in the order of ``model.parameters()`` on the first
    step after construction and rebuilds them in the order the gradients became ready
    after it; the sum of an element in a ring allreduce starts on a rank given by the
    element's position in the bucket, so with 3 or more ranks the rounding of every
    gradient depends on the layout (with 2, ``a + b == b + a``). A run resumed from a
    checkpoint starts with a fresh DDP, so its first step used the first layout where the
    uninterrupted run used the rebuilt one: not bit-exact. This hook holds every bucket
    until the last one is ready, then averages all gradients with one allreduce of one
    flat tensor per dtype in ``model.parameters()`` order (a fixed layout on every step
    of every run), and completes every bucket. The cost: no overlap of the gradient
    allreduce with the backward pass.

    Args:
        model: The module DDP wraps (its parameters' order is the layout).
    """

    def __init__(self, model: nn.Module) -> None:
        self._order = {id(p): i for i, p in enumerate(model.parameters())}
        self._pending: list[tuple[torch.Tensor, list[torch.Tensor], torch.futures.Future[Any]]] = []

    def __call__(
        self, state: object, bucket: Any
    ) -> torch.futures.Future[torch.Tensor]:
        """Holds ``bucket`` (a ``dist.GradBucket``); after the last one, reduces all of them."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append((bucket.buffer(), list(bucket.parameters()), future))
        if bucket.is_last():
            self._reduce()
        return future

    def _reduce(self) -> None:
        pending, self._pending = self._pending, []
        slices: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for buffer, params, _ in pending:
            offset = 0
            for p in params:
                part = buffer[offset : offset + p.numel()]
                slices.setdefault(buffer.dtype, []).append((self._order[id(p)], part))
                offset += p.numel()
        world = dist.get_world_size()
        for parts in slices.values():
            parts.sort(key=lambda item: item[0])
            flat = torch.cat([part for _, part in parts]).div_(world)
            dist.all_reduce(flat)
            offset = 0
            for _, part in parts:
                part.copy_(flat[offset : offset + part.numel()])
                offset += part.numel()
        for buffer, _, future in pending:
            future.set_result(buffer)


def data_parallel(model: nn.Module, context: DistContext) -> nn.Module:
    """``model`` in DDP with :class:`OrderedAllreduce` under torchrun, else itself."""
    if not context.enabled:
        return model
    ddp = DistributedDataParallel(model)
    hook = OrderedAllreduce(model)
    # DDP compares the hook's annotations with dist.GradBucket; this module's are strings.
    ddp.register_comm_hook(None, lambda state, bucket: hook(state, bucket))
    return ddp
