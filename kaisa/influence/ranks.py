"""Influence over several processes: KAISA's placement, the sums and the gathered scores.

Each rank reads its contiguous shard of the training set. The fit's sums and counts are
summed over the ranks (:meth:`Ranks.summed`); each block's eigendecompositions are placed
by KAISA's longest-processing-time placement over the strategy's worker groups
(:func:`kaisa.distributed.placement.place_layers`), computed once, on their rank, and
broadcast to every rank (every rank rotates its own examples' gradients in the ``Λ``
pass); a block's preconditioned query gradients are computed by its gradient workers and
broadcast to the other ranks of their receiver groups (:meth:`Ranks.spread`), as KAISA
sends preconditioned gradients; the scores of each rank's shard are gathered, in rank
order, on every rank (:meth:`Ranks.gathered`). With one process every call returns its
input. All traffic goes through kaisa's communicator (:mod:`kaisa.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from kaisa.blocks import CurvatureBlock
from kaisa.distributed.placement import Placement, place_layers
from kaisa.distributed.strategy import FractionSpec, WorkerGrid
from kaisa.distributed.torch_comm import make_communicator
from kaisa.utils.enums import Side

__all__ = ["Ranks"]


class Ranks:
    """The ranks of an influence computation and where each block's work happens.

    Args:
        blocks: The scored blocks, by name.
        dense: Per block, whether its A and G sides have a basis to compute.
        fraction: KAISA's gradient-worker fraction (``'comm_opt'``, ``'mem_opt'``,
            ``'hybrid_opt'`` or a number).
    """

    def __init__(self, blocks: Mapping[str, CurvatureBlock],
                 dense: Mapping[str, tuple[bool, bool]], fraction: FractionSpec) -> None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.grid = WorkerGrid.from_fraction(fraction, world)
        placed = {name: b.dims for name, b in blocks.items() if any(dense[name])}
        sides = {name: frozenset(s for s, d in zip((Side.A, Side.G), dense[name], strict=True)
                                 if not d) for name in placed}
        self.placement: Placement = place_layers(placed, self.grid, diagonal_sides=sides)
        self.everyone = tuple(range(world))
        groups = {self.everyone} | {
            (w, *receivers) for lp in self.placement.layers.values()
            for w, receivers in lp.grad_receivers.items() if receivers}
        self.comm = make_communicator(groups=sorted(groups) if world > 1 else ())
        self.rank, self.world = self.comm.rank, world

    def summed(self, tensors: list[torch.Tensor], counts: list[int]
               ) -> list[tuple[torch.Tensor, int]]:
        """Each tensor and count summed over the ranks."""
        if self.world == 1:
            return list(zip(tensors, counts, strict=True))
        handles = [self.comm.allreduce_mean(t, kind="influence") for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")  # NCCL: the device's
        total = self.comm.allreduce_mean(
            torch.tensor(counts, dtype=torch.float64, device=device), kind="influence")
        self.comm.flush()
        sums = [h.wait() * self.world for h in handles]
        totals = [round(float(c) * self.world) for c in total.wait()]
        return list(zip(sums, totals, strict=True))

    def bases(self, wanted: Mapping[tuple[str, Side], Callable[[], torch.Tensor]],
              shapes: Mapping[tuple[str, Side], tuple[int, ...]], dtype: torch.dtype,
              device: torch.device) -> dict[tuple[str, Side], torch.Tensor]:
        """Each ``(block, side)`` basis computed on its placed rank, sent to every rank."""
        out: dict[tuple[str, Side], torch.Tensor] = {}
        handles = []
        for (name, side), compute in wanted.items():
            lp = self.placement[name]
            src = lp.a_rank if side is Side.A else lp.g_rank
            if src == self.rank:
                out[name, side] = compute().to(dtype).contiguous()
            else:
                out[name, side] = torch.empty(shapes[name, side], dtype=dtype, device=device)
            if self.world > 1:
                handles.append(self.comm.broadcast(out[name, side], src, self.everyone,
                                                   kind="influence"))
        self.comm.flush()
        for handle in handles:
            handle.wait()
        return out

    def computes(self, name: str) -> bool:
        """Whether this rank preconditions block ``name``'s queries (a gradient worker)."""
        return name not in self.placement.layers or self.placement[name].is_grad_worker(
            self.rank)

    def spread(self, mine: Mapping[str, torch.Tensor | None],
               shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
               device: torch.device) -> dict[str, torch.Tensor]:
        """Every block's preconditioned queries on every rank, from its gradient workers."""
        out: dict[str, torch.Tensor] = {}
        handles = []
        for name, local in mine.items():
            if local is not None:
                out[name] = local
                lp = self.placement.layers.get(name)
                receivers = lp.grad_receivers.get(self.rank, ()) if lp is not None else ()
                if receivers:
                    handles.append(self.comm.broadcast(local.contiguous(), self.rank,
                                                       (self.rank, *receivers),
                                                       kind="influence"))
                continue
            lp = self.placement[name]
            source = lp.grad_source(self.rank)
            out[name] = torch.empty(shapes[name], dtype=dtype, device=device)
            group = (source, *lp.grad_receivers[source])
            handles.append(self.comm.broadcast(out[name], source, group, kind="influence"))
        self.comm.flush()
        for handle in handles:
            handle.wait()
        return out

    def gathered(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's ``local`` scores (its shard along the last dimension), in rank order."""
        if self.world == 1:
            return local
        sizes = torch.zeros(self.world, dtype=torch.float64, device=local.device)
        sizes[self.rank] = local.shape[-1]
        handle = self.comm.allreduce_mean(sizes, kind="influence")
        self.comm.flush()
        counts = [round(float(s) * self.world) for s in handle.wait()]
        parts = [local if src == self.rank else local.new_empty(*local.shape[:-1], n)
                 for src, n in enumerate(counts)]
        handles = [self.comm.broadcast(part.contiguous(), src, self.everyone, kind="influence")
                   for src, part in enumerate(parts)]
        self.comm.flush()
        return torch.cat([h.wait() for h in handles], dim=-1)
