"""Influence over several processes: sums of the fit and the gathered scores.

Each rank reads its contiguous shard of the training set; these two collectives (kaisa's
communicator, :mod:`kaisa.distributed`) make every rank hold the one-process fit and every
score. In one process they return their input.
"""

from __future__ import annotations

import torch

from kaisa.distributed.protocol import Communicator

__all__ = ["gathered", "summed"]


def summed(comm: Communicator, tensors: list[torch.Tensor], counts: list[int]
           ) -> list[tuple[torch.Tensor, int]]:
    """Each tensor and count summed over the ranks."""
    world = comm.world_size
    if world == 1:
        return list(zip(tensors, counts, strict=True))
    handles = [comm.allreduce_mean(t, kind="influence") for t in tensors]
    total = comm.allreduce_mean(torch.tensor(counts, dtype=torch.float64), kind="influence")
    comm.flush()
    sums = [h.wait() * world for h in handles]
    totals = [round(float(c) * world) for c in total.wait()]
    return list(zip(sums, totals, strict=True))


def gathered(comm: Communicator, local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` scores (its shard along the last dimension), in rank order."""
    world = comm.world_size
    if world == 1:
        return local
    sizes = torch.zeros(world, dtype=torch.float64)
    sizes[comm.rank] = local.shape[-1]
    handle = comm.allreduce_mean(sizes, kind="influence")
    comm.flush()
    counts = [round(float(s) * world) for s in handle.wait()]
    parts = [local if src == comm.rank else local.new_empty(*local.shape[:-1], n)
             for src, n in enumerate(counts)]
    handles = [comm.broadcast(part, src, tuple(range(world)), kind="influence")
               for src, part in enumerate(parts)]
    comm.flush()
    return torch.cat([h.wait() for h in handles], dim=-1)
