"""K-FAC over a model sharded by FSDP2: each block's gradient to its workers, each rank its rows.

Under ``fully_shard`` the gradients are ``DTensor`` objects sharded on dim 0
(:mod:`kaisa.utils.shards`). A step preconditions the blocks in the groups :func:`rounds`
gives: all at once for an unsharded model (the engine fuses their broadcasts), one block
at a time for a sharded one. For a sharded block :class:`ShardedBlocks`

1. assembles the block's full gradient on its gradient workers only (the placement's;
   every rank for a diagonal block, which is not placed): each worker receives the rows
   the block covers from one holder of each shard in its own replica (on an HSDP mesh,
   the ranks with its replicate coordinates), in one all-to-all;
2. has each worker run the rule (the method's preconditioning, a product's per-block
   rule) on it;
3. sends every other rank, from the worker KAISA's receiver groups give it, only the rows
   of the direction its shards hold, with the whole block's ``<direction, grad>``,
   whether the direction is finite and whether the worker had a result (one all-to-all;
   none under COMM-OPT, where every rank is a worker).

A rank's entry then carries only its rows (``grad`` from its own shards), with the whole
block's ``<direction, grad>`` and finiteness (what the KL clip and the non-finite guard
need, the same on every rank). So a rank holds a block's full gradient and direction
only while it is a worker of that block, one block at a time, besides its shards
(``docs/distributed.md``, "FSDP2"). Who sends which rows is a function of the parameters'
meshes and the placement (:class:`_Plan`, computed once per block on every rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.distributed.placement import Placement
from kaisa.distributed.protocol import Communicator
from kaisa.utils.finite import all_finite
from kaisa.utils.shards import row_sources, rows_by_rank, take_held

__all__ = ["ShardedBlocks", "rounds"]

#: A block's rule (:data:`kaisa.distributed.engine.BlockRule`).
_Rule = Callable[[CurvatureBlock, torch.Tensor], torch.Tensor | None]

_ALIGN = 8  # bytes: every piece of a chunk starts aligned for any dtype
_HEADER = 3  # float64 values before a direction's rows: <P, g>, finite, valid


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


@dataclass(frozen=True)
class _Piece:
    """Rows ``rows`` (global, of dim 0) of the block's parameter number ``index``."""

    index: int
    rows: range


@dataclass(frozen=True)
class _Plan:
    """Who sends which rows of one sharded block; the same on every rank.

    Attributes:
        workers: The ranks that assemble the full gradient and run the rule.
        gather: ``(source, worker) -> pieces`` the source sends (never to itself).
        own: ``worker -> pieces`` it holds itself.
        held: Per rank, the block's rows its shards hold (one piece per parameter).
        source: Per rank that is not a worker, the worker that sends it its rows.
        row_numel: Elements in one row of each parameter.
        first: Per rank, the first row of each parameter its shard holds.
    """

    workers: tuple[int, ...]
    gather: dict[tuple[int, int], tuple[_Piece, ...]]
    own: dict[int, tuple[_Piece, ...]]
    held: tuple[tuple[_Piece, ...], ...]
    source: dict[int, int]
    row_numel: tuple[int, ...]
    first: tuple[tuple[int, ...], ...]


def _plan(block: CurvatureBlock, workers: Sequence[int], source: Callable[[int], int],
          world: int) -> _Plan:
    params = block.parameters()
    covered = []
    for p, rows in zip(params, block.row_slices(), strict=True):
        span = range(p.shape[0])[rows or slice(None)]
        if span.step != 1:
            raise ValueError(f"row slices of a sharded parameter must be contiguous, got {rows}")
        covered.append(span)

    def cap(rows: range, i: int) -> range:
        lo = max(rows.start, covered[i].start)
        return range(lo, max(lo, min(rows.stop, covered[i].stop)))

    by_rank = []
    for p in params:
        assert isinstance(p, DTensor)
        spans = rows_by_rank(p)
        if missing := [r for r in range(world) if r not in spans]:
            raise ValueError(f"ranks {missing} are not on the device mesh {p.device_mesh} of "
                             f"block {block.name!r}: kaisa needs every rank on every "
                             "parameter's mesh")
        by_rank.append(spans)
    held = tuple(tuple(_Piece(i, cap(spans[r], i)) for i, spans in enumerate(by_rank))
                 for r in range(world))
    gather: dict[tuple[int, int], tuple[_Piece, ...]] = {}
    own: dict[int, tuple[_Piece, ...]] = {}
    for w in workers:
        own[w] = ()
        for i, p in enumerate(params):
            assert isinstance(p, DTensor)
            for src, span in row_sources(p, w):
                piece = _Piece(i, cap(span, i))
                if not piece.rows:
                    continue
                if src == w:
                    own[w] += (piece,)
                else:
                    gather[(src, w)] = (*gather.get((src, w), ()), piece)
    return _Plan(
        workers=tuple(workers), gather=gather, own=own, held=held,
        source={r: source(r) for r in range(world) if r not in workers},
        row_numel=tuple(math.prod(p.shape[1:]) for p in params),
        first=tuple(tuple(spans[r].start for spans in by_rank) for r in range(world)),
    )


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _pack(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes, joined, each padded to a multiple of ``_ALIGN``."""
    out = []
    for t in parts:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        out.append(raw)
        if (pad := _padded(raw.numel()) - raw.numel()) > 0:
            out.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8, device=device)


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    if not isinstance(grad, DTensor):
        raise ValueError("the gradient of a parameter FSDP2 shards must be a DTensor, got a "
                         f"{type(grad).__name__}")
    local: torch.Tensor = grad.to_local()
    return local


class ShardedBlocks:
    """The per-step exchanges of the blocks FSDP2 shards, for one engine.

    Args:
        communicator: The engine's communicator (:meth:`~kaisa.distributed.Communicator.exchange`).
        placement: The engine's placement (gradient workers, receiver sources).
        waiting: A context that accounts the time spent communicating.
    """

    def __init__(self, communicator: Communicator, placement: Placement,
                 waiting: Callable[[], AbstractContextManager[None]]) -> None:
        self._comm = communicator
        self._placement = placement
        self._waiting = waiting
        self._plans: dict[str, _Plan] = {}

    def _plan_of(self, block: CurvatureBlock) -> _Plan:
        plan = self._plans.get(block.name)
        if plan is None:
            world = self._comm.world_size
            placed = self._placement.layers.get(block.name)
            if placed is None:  # a diagonal block: every rank preconditions it
                plan = _plan(block, range(world), lambda r: r, world)
            else:
                plan = _plan(block, placed.grad_workers, placed.grad_source, world)
            self._plans[block.name] = plan
        return plan

    def transform(
        self, block: CurvatureBlock, rule: _Rule,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[Preconditioned]:
        """``block``'s entry: ``rule`` on its full gradient by its workers, this rank's rows.

        Every rank must call it for the same blocks in the same order.

        Args:
            block: A block whose parameters FSDP2 shards.
            rule: The per-block computation (run on the gradient workers).
            grads: ``parameter -> gradient`` (``DTensor``); by default the parameters'
                ``.grad``.

        Returns:
            The block's entry (``grad`` and ``direction`` this rank's rows, flat), or
            nothing when the weight has no gradient or, with every rank a worker, the
            rule gave no result.
        """
        params = block.parameters()
        local = [_local(p.grad if grads is None else grads.get(p)) for p in params]
        if local[0] is None:
            return []
        plan, rank = self._plan_of(block), self._comm.rank
        device, dtype = local[0].device, local[0].dtype
        whole = self._gather(plan, params, local, device)
        result: torch.Tensor | None = None
        header = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64, device=device)
        if whole is not None:
            matrix = block.gradient_matrix(whole)
            assert matrix is not None
            found = rule(block, matrix)
            if found is not None:
                result = found.to(dtype)
                header = torch.stack([(result * matrix).sum(dtype=torch.float64),
                                      all_finite(result).to(torch.float64),
                                      torch.ones((), dtype=torch.float64, device=device)])
            del whole, matrix
        grad = torch.cat([
            torch.zeros(len(piece.rows) * plan.row_numel[piece.index], dtype=dtype,
                        device=device)
            if g is None else g[self._local_slice(plan, piece)].reshape(-1)
            for g, piece in zip(local, plan.held[rank], strict=True)
        ])
        parts = None if result is None else block.split(result)

        def rows_of(r: int | None) -> torch.Tensor:
            """Rank ``r``'s rows of the direction (this rank's: ``None``); zero without one."""
            if parts is None:
                count = sum(len(piece.rows) * plan.row_numel[piece.index]
                            for piece in plan.held[rank if r is None else r])
                return torch.zeros(count, dtype=dtype, device=device)
            return take_held(params, parts, block.row_slices(), rank=r)

        if not plan.source:  # every rank is a worker
            if result is None:
                return []
            return [Preconditioned(block, grad, rows_of(None), inner=header[0],
                                   finite=header[1] > 0)]

        chunks = {r: _pack([header, rows_of(r)], device)
                  for r, w in plan.source.items() if w == rank}
        sizes = {}
        if rank in plan.source:
            sizes[plan.source[rank]] = (_padded(_HEADER * 8)
                                        + _padded(grad.numel() * dtype.itemsize))
        with self._waiting():
            got = self._comm.exchange(chunks, sizes, device=device, kind="gradients")
        if rank in plan.source:
            chunk = got[plan.source[rank]]
            header = chunk[: _HEADER * 8].view(torch.float64)
            direction = chunk[_padded(_HEADER * 8):].view(dtype)[: grad.numel()]
        else:
            direction = rows_of(None)
        return [Preconditioned(block, grad, direction, header[2] > 0, inner=header[0],
                               finite=header[1] > 0)]

    def _local_slice(self, plan: _Plan, piece: _Piece) -> slice:
        """Where ``piece`` (rows this rank holds) lies in this rank's local shard."""
        start = plan.first[self._comm.rank][piece.index]
        return slice(piece.rows.start - start, piece.rows.stop - start)

    def _gather(self, plan: _Plan, params: Sequence[torch.Tensor],
                local: Sequence[torch.Tensor | None],
                device: torch.device) -> list[torch.Tensor | None] | None:
        """The block's full gradients on its workers (``None`` elsewhere): one all-to-all."""
        rank = self._comm.rank
        present = [g is not None for g in local]

        def rows(piece: _Piece) -> torch.Tensor:
            g = local[piece.index]
            assert g is not None
            return g[self._local_slice(plan, piece)]

        def nbytes(piece: _Piece) -> int:  # the gradients' dtype is the same on every rank
            g = local[piece.index]
            assert g is not None
            itemsize = g.dtype.itemsize
            return _padded(len(piece.rows) * plan.row_numel[piece.index] * itemsize)

        chunks = {dst: _pack([rows(piece) for piece in pieces if present[piece.index]], device)
                  for (src, dst), pieces in plan.gather.items() if src == rank}
        sizes = {src: sum(nbytes(piece) for piece in pieces if present[piece.index])
                 for (src, dst), pieces in plan.gather.items() if dst == rank}
        got: dict[int, torch.Tensor] = {}
        if plan.gather:
            with self._waiting():
                got = self._comm.exchange(chunks, sizes, device=device, kind="gradient_gather")
        if rank not in plan.workers:
            return None
        whole = [None if g is None else g.new_empty(p.shape) for p, g in zip(params, local,
                                                                             strict=True)]
        for piece in plan.own[rank]:
            target = whole[piece.index]
            if target is not None:
                target[piece.rows.start : piece.rows.stop] = rows(piece)
        for (src, dst), pieces in plan.gather.items():
            if dst != rank:
                continue
            offset = 0
            for piece in pieces:
                target = whole[piece.index]
                if target is None:
                    continue
                size = nbytes(piece)
                values = got[src][offset : offset + size].view(target.dtype)
                block_rows = target[piece.rows.start : piece.rows.stop]
                block_rows.copy_(values[: block_rows.numel()].view(block_rows.shape))
                offset += size
        return whole
