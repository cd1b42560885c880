"""Parameters sharded by FSDP2 (``fully_shard``): their full gradients and their local rows.

Under ``torch.distributed.fsdp.fully_shard`` a parameter and its gradient are
``DTensor`` objects sharded on dim 0 over the shard dimension of their mesh (replicated over the
replicate dimension of an HSDP mesh); each rank holds the rows
:func:`local_rows` names. kaisa preconditions a block's full gradient
(:func:`full_tensor`, an all-gather on the parameter's mesh, started by the engine) and
writes back only the rows this rank holds (:func:`copy_rows`). Plain tensors pass
through both unchanged, so the same code serves unsharded models.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = ["copy_rows", "full_tensor", "is_sharded", "local_rows"]


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter or gradient under FSDP2)."""
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor``'s full value (a collective on its mesh), else ``t``.

    Every rank of the ``DTensor``'s mesh must call it, in the same order.
    """
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def local_rows(t: DTensor) -> range:
    """The rows (of dim 0 of the global tensor) this rank's local shard of ``t`` holds.

    Raises:
        ValueError: If ``t`` is sharded on a dimension other than 0 (FSDP2 shards dim 0).
    """
    for placement in t.placements:
        if isinstance(placement, Shard) and placement.dim != 0:
            raise ValueError(
                f"kaisa supports DTensor parameters sharded on dim 0 (FSDP2's fully_shard), "
                f"got placements {t.placements}"
            )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if not shape:  # a 0-d tensor is replicated
        return range(1)
    return range(offset[0], offset[0] + shape[0])


def copy_rows(target: torch.Tensor, value: torch.Tensor, rows: slice | None = None) -> None:
    """Writes ``value``, rows ``rows`` of the global tensor (all: ``None``), into ``target``.

    A plain ``target`` takes ``value`` into those rows. A ``DTensor`` ``target`` takes, in
    its local shard, the rows it holds of those rows (none when they do not meet).

    Args:
        target: A gradient (plain or ``DTensor``).
        value: The new values of rows ``rows``, of their shape.
        rows: A slice of dim 0 with step 1, or ``None``.
    """
    if not isinstance(target, DTensor):
        (target if rows is None else target[rows]).copy_(value)
        return
    held = local_rows(target)
    start, stop, step = (0, target.shape[0], 1) if rows is None else rows.indices(
        target.shape[0])
    if step != 1:
        raise ValueError(f"row slices of a sharded gradient must be contiguous, got {rows}")
    lo, hi = max(start, held.start), min(stop, held.stop)
    if lo >= hi:
        return
    local = target.to_local()
    local[lo - held.start : hi - held.start].copy_(value[lo - start : hi - start])
