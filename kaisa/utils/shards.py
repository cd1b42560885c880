"""Parameters sharded by FSDP2 (``fully_shard``): full gradients and the rows a rank holds.

Under ``torch.distributed.fsdp.fully_shard`` a parameter and its gradient are
``DTensor`` objects sharded on dim 0 over the shard dimension of their mesh (replicated
over the replicate dimension of an HSDP mesh); each rank holds the rows
:func:`local_rows` names. kaisa preconditions a block's full gradient
on the block's gradient workers, takes of the result the rows each rank holds, as one flat
vector (:func:`take_held`), and each rank writes its rows into its local shards
(:func:`held_parts`, :func:`rows_of`). Which rows any
rank of the mesh holds (:func:`rows_on`) and from which ranks a rank reads a whole tensor
(:func:`row_sources`) let the distribution send each rank only what it needs
(:mod:`kaisa.distributed.fsdp`). A leaf module: the blocks use it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)

__all__ = [
    "held_parts", "is_sharded", "local_rows", "row_sources",
    "rows_by_rank", "rows_of", "rows_on", "shard_count", "take_held",
]


def is_sharded(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` (a parameter or gradient under FSDP2)."""
    return isinstance(t, DTensor)


def shard_count(t: DTensor) -> int:
    """Into how many distinct shards ``t`` is split (its mesh dimensions that shard it).

    An HSDP mesh's replicate dimension holds copies: ``sum over ranks of a local quantity``
    divided by ``world / shard_count`` counts each shard once.
    """
    return math.prod(t.device_mesh.size(i) for i, placement in enumerate(t.placements)
                     if isinstance(placement, Shard))


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


def _mesh_coordinates(t: DTensor) -> dict[int, tuple[int, ...]]:
    """``global rank -> coordinate`` on ``t``'s mesh, checking the placements are FSDP2's."""
    for placement in t.placements:
        if type(placement) not in (Shard, Replicate) or (
                isinstance(placement, Shard) and placement.dim != 0):
            raise ValueError(
                "kaisa supports DTensor parameters sharded on dim 0 and replicated "
                f"(FSDP2's fully_shard, HSDP), got placements {t.placements}"
            )
    ranks = t.device_mesh.mesh
    return {int(ranks[c]): c for c in itertools.product(*(range(n) for n in ranks.shape))}


def _rows_at(t: DTensor, coordinate: Sequence[int]) -> range:
    shape, offset = _compute_local_shape_and_global_offset(
        t.shape, tuple(t.device_mesh.mesh.shape), list(coordinate), t.placements)
    return range(offset[0], offset[0] + shape[0])


def rows_by_rank(t: DTensor) -> dict[int, range]:
    """:func:`rows_on` for every rank of ``t``'s mesh: ``global rank -> rows``."""
    return {rank: _rows_at(t, c) for rank, c in _mesh_coordinates(t).items()}


def rows_on(t: DTensor, rank: int) -> range:
    """The rows (of dim 0 of the global tensor) global rank ``rank``'s shard of ``t`` holds.

    :func:`local_rows` for any rank of ``t``'s mesh (no communication).

    Raises:
        ValueError: If ``rank`` is not on ``t``'s mesh, or ``t`` is placed otherwise than
            FSDP2 places parameters (``Shard(0)`` and ``Replicate()`` mesh dimensions).
    """
    coordinates = _mesh_coordinates(t)
    if rank not in coordinates:
        raise ValueError(f"rank {rank} is not on the device mesh {t.device_mesh} of a "
                         "sharded parameter: kaisa needs every rank on every parameter's mesh")
    return _rows_at(t, coordinates[rank])


def row_sources(t: DTensor, rank: int) -> list[tuple[int, range]]:
    """The ranks ``rank`` reads the whole of ``t`` from: ``(source, its rows)`` by row.

    One holder per shard: the one in ``rank``'s replica (its coordinates on the mesh's
    replicated dimensions; ``rank`` itself for the rows it holds). Shards without rows
    are left out.

    Raises:
        ValueError: As :func:`rows_on`.
    """
    coordinates = _mesh_coordinates(t)
    if rank not in coordinates:
        rows_on(t, rank)  # raises
    own = coordinates[rank]
    shard_dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    ranks = t.device_mesh.mesh
    out = []
    for shard in itertools.product(*(range(ranks.shape[d]) for d in shard_dims)):
        at = list(own)
        for d, index in zip(shard_dims, shard, strict=True):
            at[d] = index
        rows = _rows_at(t, at)
        if len(rows):
            out.append((int(ranks[tuple(at)]), rows))
    return sorted(out, key=lambda item: item[1].start)


def _held(param: torch.Tensor, rows: slice | None,
          rank: int | None = None) -> tuple[slice, slice]:
    """``(rows of the block's part, rows of the shard)`` of ``param`` a rank holds.

    ``rank``: a global rank of ``param``'s mesh; this rank by default.
    """
    assert isinstance(param, DTensor)
    held = local_rows(param) if rank is None else rows_on(param, rank)
    start, stop, step = (0, param.shape[0], 1) if rows is None else rows.indices(
        param.shape[0])
    if step != 1:
        raise ValueError(f"row slices of a sharded parameter must be contiguous, got {rows}")
    lo, hi = max(start, held.start), min(stop, held.stop)
    hi = max(lo, hi)
    return slice(lo - start, hi - start), slice(lo - held.start, hi - held.start)


def take_held(
    params: Sequence[torch.Tensor], parts: Sequence[torch.Tensor],
    rows: Sequence[slice | None], rank: int | None = None,
) -> torch.Tensor:
    """The rows a rank holds of a block's per-parameter parts, flattened and joined.

    Args:
        params: The block's parameters (``DTensor`` objects).
        parts: One part per parameter, the shape of the rows ``rows`` of it (the block's
            :meth:`~kaisa.blocks.CurvatureBlock.split`).
        rows: The rows of each parameter the block covers (``None``: all).
        rank: Whose rows (a global rank of the parameters' mesh); this rank's by default.

    Returns:
        A 1-d tensor, the input of :func:`held_parts` on that rank.
    """
    pieces = [part[_held(p, r, rank)[0]].reshape(-1)
              for p, part, r in zip(params, parts, rows, strict=True)]
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
