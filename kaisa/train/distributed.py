"""torchrun integration: process-group setup and rank helpers."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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
            "nccl" if use_cuda else "gloo", rank=rank, world_size=world_size, timeout=timeout
        )
    return DistContext(rank=rank, world_size=world_size, device=target)


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
