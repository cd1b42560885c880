"""Every block's decompositions on every rank, for a checkpoint (a collective).

Under MEM-OPT and HYBRID-OPT a Kronecker block's decompositions live on its gradient
workers only, so the state dict of one rank lacks the others'. Loading such a state
recomputes the missing decompositions from the running factors, which have moved on
since the last decomposition step: a resumed run then differs from the uninterrupted
one. :func:`gather_decompositions` has one gradient worker of each such block broadcast
the block's decomposition state to every rank: first which entries it holds, then the
entries (the method's :meth:`~kaisa.methods.SecondOrderMethod.state_shapes`, in
``inv_dtype``). With COMM-OPT, or one rank, every rank holds every decomposition and
nothing is sent.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.distributed.engine import DistributedEngine
from kaisa.distributed.protocol import CommHandle
from kaisa.methods import SecondOrderMethod

__all__ = ["gather_decompositions"]

_KIND = "checkpoint"


def gather_decompositions(
    engine: DistributedEngine,
    blocks: Mapping[str, CurvatureBlock],
    method: SecondOrderMethod,
    inv_dtype: torch.dtype,
) -> dict[str, dict[str, torch.Tensor]]:
    """The decomposition entries of the blocks whose gradient workers are not every rank.

    Every rank must call it (in the same order as its other K-FAC collectives).

    Args:
        engine: The engine (placement, rank, communicator).
        blocks: The blocks, in model order (the same on every rank).
        method: The second-order method (the entries' names and shapes).
        inv_dtype: The entries' dtype.

    Returns:
        ``name -> {entry: tensor}`` for those blocks on this rank: received, or this
        rank's own where it is the source (``{}`` with COMM-OPT or one rank). A block
        its source holds no decomposition of yet has no entries.
    """
    world = tuple(range(engine.world_size))
    shared = [
        (name, block, engine.placement[name].grad_workers[0])
        for name, block in blocks.items()
        if not block.diagonal and len(engine.placement[name].grad_workers) < len(world)
    ]
    if not shared:
        return {}
    comm, rank = engine.communicator, engine.rank
    entries = {name: method.state_shapes(block.groups, *block.dims) for name, block, _ in shared}
    flags: list[CommHandle] = []
    for name, block, src in shared:
        held = torch.tensor([float(key in block.decomposition) for key in entries[name]],
                            device=block.weight.device)
        flags.append(comm.broadcast(held, src, world, kind=_KIND))
    comm.flush()
    present = [
        [key for key, flag in zip(entries[name], handle.wait().tolist(), strict=True) if flag]
        for (name, _, _), handle in zip(shared, flags, strict=True)
    ]
    pending: list[tuple[str, str, CommHandle]] = []
    for (name, block, src), keys in zip(shared, present, strict=True):
        for key in keys:
            if src == rank:
                tensor = block.decomposition[key].to(inv_dtype).contiguous()
            else:
                tensor = torch.empty(entries[name][key], dtype=inv_dtype,
                                     device=block.weight.device)
            pending.append((name, key, comm.broadcast(tensor, src, world, kind=_KIND)))
    comm.flush()
    gathered: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _, _ in shared}
    for name, key, handle in pending:
        gathered[name][key] = handle.wait()
    return gathered
