"""K-FAC over a model sharded by FSDP2: one block at a time, each rank keeps its rows.

Under ``fully_shard`` the gradients are ``DTensor`` objects sharded on dim 0
(:mod:`kaisa.shards`). A step preconditions the blocks in the groups :func:`rounds`
gives: all at once for an unsharded model (the engine fuses their broadcasts), one block
at a time for a sharded one. For each block every rank gathers its full gradient
(:meth:`~kaisa.distributed.DistributedEngine.full_gradients`), its gradient workers
precondition it as the placement says and send the result to the other ranks, and
:func:`held` keeps of the gradient and the direction only the rows this rank's shards
hold, with the whole block's ``<direction, grad>`` and finiteness (what the KL clip and
the non-finite guard need, the same on every rank). So a rank holds at most one block's
full gradient and direction, besides its shards (``docs/distributed.md``, "FSDP2").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.finite import all_finite

__all__ = ["held", "rounds"]


def rounds(blocks: Mapping[str, CurvatureBlock]) -> list[list[str]]:
    """The blocks' names, in model order, in the groups a step preconditions together.

    Args:
        blocks: The curvature blocks by name.

    Returns:
        One group of every block, or one group per block when FSDP2 shards the model.
    """
    names = list(blocks)
    if any(block.sharded() for block in blocks.values()):
        return [[name] for name in names]
    return [names]


def held(entry: Preconditioned) -> Preconditioned:
    """A sharded block's entry cut to the rows this rank holds; other entries as they are.

    Args:
        entry: One block's full gradient and direction.

    Returns:
        The entry with ``grad`` and ``direction`` the held rows
        (:meth:`~kaisa.blocks.CurvatureBlock.held_rows`), ``inner`` the whole block's
        ``<direction, grad>`` and ``finite`` whether its direction is finite.
    """
    block = entry.block
    if not block.sharded():
        return entry
    grad, direction = entry.grad, entry.direction
    return Preconditioned(
        block, block.held_rows(grad), block.held_rows(direction), entry.valid,
        inner=(direction * grad).sum(dtype=torch.float64), finite=all_finite(direction),
    )
