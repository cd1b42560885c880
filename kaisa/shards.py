"""Parameters sharded by FSDP2 (``fully_shard``): full gradients and the rows a rank holds.

Under ``torch.distributed.fsdp.fully_shard`` a parameter and its gradient are
``DTensor`` objects sharded on dim 0 over the shard dimension of their mesh (replicated
over the replicate dimension of an HSDP mesh); each rank holds the rows
:func:`local_rows` names. kaisa preconditions a block's full gradient
(:func:`full_tensor`, an all-gather on the parameter's mesh, started by the engine), keeps
of the result only the rows this rank holds, as one flat vector (:func:`take_held`), and
writes them into the local shards (:func:`held_parts`, :func:`rows_of`). A leaf module:
the blocks use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

__all__ = [
    "full_tensor", "held_parts", "is_sharded", "local_rows", "refuse_sharded", "rows_of",
    "take_held",
]


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter or gradient under FSDP2)."""
    return isinstance(t, DTensor)


def refuse_sharded(model: torch.nn.Module, product: str) -> None:
    """Raises ``ValueError`` if FSDP2 shards ``model`` (for products that do not support it).

    Args:
        model: The model.
        product: The product's name, for the message.
    """
    if any(is_sharded(p) for p in model.parameters()):
        raise ValueError(
            f"{product} does not support models sharded by FSDP2 (fully_shard) yet: its "
            "update is applied to the parameters directly; use kaisa.KFACPreconditioner "
            "with a torch.optim optimizer"
        )


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a ``DTensor``'s full value (a collective on its mesh), else ``t``.

    Every rank of the ``DTensor``'s mesh must call it, in the same order.
    """
    if isinstance(t, DTensor):
        whole: torch.Tensor = t.full_tensor()
        return whole
    return t


def local_rows(t: DTensor) -> range:
    """The rows (of dim 0 of the global tensor) this rank's local shard of ``t`` holds.

    Raises:
        ValueError: If ``t`` is sharded on a dimension other than 0 (FSDP2 shards dim 0).
    """
    for placement in t.placements:
        if isinstance(placement, Shard) and placement.dim != 0:
            raise ValueError(
                "kaisa supports DTensor parameters sharded on dim 0 (FSDP2's fully_shard), "
                f"got placements {t.placements}"
            )
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return range(offset[0], offset[0] + shape[0])


def _held(param: torch.Tensor, rows: slice | None) -> tuple[slice, slice]:
    """``(rows of the block's part, rows of the local shard)`` this rank holds of ``param``."""
    assert isinstance(param, DTensor)
    held = local_rows(param)
    start, stop, step = (0, param.shape[0], 1) if rows is None else rows.indices(
        param.shape[0])
    if step != 1:
        raise ValueError(f"row slices of a sharded parameter must be contiguous, got {rows}")
    lo, hi = max(start, held.start), min(stop, held.stop)
    hi = max(lo, hi)
    return slice(lo - start, hi - start), slice(lo - held.start, hi - held.start)


def take_held(
    params: Sequence[torch.Tensor], parts: Sequence[torch.Tensor],
    rows: Sequence[slice | None],
) -> torch.Tensor:
    """The rows this rank holds of a block's per-parameter parts, flattened and joined.

    Args:
        params: The block's parameters (``DTensor`` objects).
        parts: One part per parameter, the shape of the rows ``rows`` of it (the block's
            :meth:`~kaisa.blocks.CurvatureBlock.split`).
        rows: The rows of each parameter the block covers (``None``: all).

    Returns:
        A 1-d tensor, the input of :func:`held_parts`.
    """
    pieces = [part[_held(p, r)[0]].reshape(-1) for p, part, r in zip(params, parts, rows,
                                                                      strict=True)]
    return torch.cat(pieces)


def held_parts(
    held: torch.Tensor, params: Sequence[torch.Tensor], rows: Sequence[slice | None]
) -> list[torch.Tensor]:
    """:func:`take_held` output split back: per parameter, its held rows (views).

    Args:
        held: The held rows, as :func:`take_held` joined them.
        params: The block's parameters (``DTensor`` objects).
        rows: As for :func:`take_held`.
    """
    out, offset = [], 0
    for p, r in zip(params, rows, strict=True):
        local = _held(p, r)[1]
        shape = (local.stop - local.start, *p.shape[1:])
        count = math.prod(shape)
        out.append(held[offset : offset + count].view(shape))
        offset += count
    return out


def rows_of(t: torch.Tensor, param: torch.Tensor, rows: slice | None) -> torch.Tensor:
    """The rows ``rows`` of ``t`` (``param`` or its gradient) this rank writes (a view).

    A plain tensor's rows ``rows`` (all: ``None``); of a ``DTensor``, the part of its local
    shard that holds them (:func:`held_parts` gives the values of that shape).
    """
    if not isinstance(t, DTensor):
        return t if rows is None else t[rows]
    view: torch.Tensor = t.to_local()[_held(param, rows)[1]]
    return view
