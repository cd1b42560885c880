"""Every block's decompositions (and running factors) on every rank, for a checkpoint.

Under MEM-OPT and HYBRID-OPT a Kronecker block's decompositions live on its gradient
workers only, so the state dict of one rank lacks the others'. Loading such a state
recomputes the missing decompositions from the running factors, which have moved on
since the last decomposition step: a resumed run then differs from the uninterrupted
one. :func:`gather_decompositions` has one gradient worker of each such block broadcast
the block's decomposition state to every rank: first which entries it holds, then the
entries (the method's :meth:`~kaisa.methods.SecondOrderMethod.state_shapes`, in
``inv_dtype``). With COMM-OPT, or one rank, every rank holds every decomposition and
nothing is sent. Under FSDP2 the running factors live on the ranks that decompose
them only; :func:`gather_factors` has those ranks broadcast them the same way. Both are
collectives.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.distributed.engine import DistributedEngine
from kaisa.distributed.protocol import CommHandle
from kaisa.methods import SecondOrderMethod
from kaisa.utils.enums import Side

__all__ = ["gather_decompositions", "gather_factors"]

_KIND = "checkpoint"

#: Factor dtypes, by the code :func:`gather_factors` sends ahead.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def gather_factors(
    engine: DistributedEngine, blocks: Mapping[str, CurvatureBlock]
) -> dict[str, dict[str, torch.Tensor]]:
    """The running factors and skip counts of the blocks not every rank keeps (FSDP2).

    Every rank must call it. ``A`` and ``skipped_a`` come from the rank that decomposes
    A, ``G`` and ``skipped_g`` from G's.

    Args:
        engine: The engine (placement, which ranks keep the factors, communicator).
        blocks: The blocks, in model order (the same on every rank).

    Returns:
        ``name -> {entry: tensor}`` for those blocks (``{}`` unless factors are owned);
        an entry its source does not hold yet is left out.
    """
    world = tuple(range(engine.world_size))
    shared = [(name, block) for name, block in blocks.items()
              if len(engine.factor_holders(name)) < len(world)]
    if not shared:
        return {}
    comm, rank = engine.communicator, engine.rank
    sides = (("A", "skipped_a", Side.A), ("G", "skipped_g", Side.G))
    flags: list[tuple[str, CurvatureBlock, str, str, Side, int, CommHandle]] = []
    for name, block in shared:
        lp = engine.placement[name]
        for key, count, side in sides:
            src = lp.a_rank if side is Side.A else lp.g_rank
            factor = block.factors.a if side is Side.A else block.factors.g
            code = 0 if factor is None else 1 + _DTYPES.index(factor.dtype)
            held = torch.tensor([float(code)], device=block.weight.device)
            flags.append((name, block, key, count, side, src,
                          comm.broadcast(held, src, world, kind=_KIND)))
    comm.flush()
    pending: list[tuple[str, str, CommHandle]] = []
    for name, block, key, count, side, src, handle in flags:
        code = int(handle.wait()[0])  # 0: the source holds none; else 1 + its dtype's index
        if code == 0:
            continue
        factor = block.a if side is Side.A else block.g
        skipped = block.factors.skipped_a if side is Side.A else block.factors.skipped_g
        device = block.weight.device
        if src == rank:
            assert factor is not None
            tensors = (factor.contiguous(), torch.zeros((), dtype=torch.int64, device=device)
                       if skipped is None else skipped)
        else:
            tensors = (torch.empty(block.factor_shape(side), dtype=_DTYPES[code - 1],
                                   device=device),
                       torch.zeros((), dtype=torch.int64, device=device))
        pending.append((name, key, comm.broadcast(tensors[0], src, world, kind=_KIND)))
        pending.append((name, count, comm.broadcast(tensors[1], src, world, kind=_KIND)))
    comm.flush()
    gathered: dict[str, dict[str, torch.Tensor]] = {name: {} for name, _ in shared}
    for name, key, handle in pending:
        gathered[name][key] = handle.wait()
    return gathered
