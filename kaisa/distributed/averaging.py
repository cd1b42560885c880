"""Where each step's factors go: averaged on every rank, or reduced to their owners.

With DDP (and one process) every rank keeps every running factor: the statistics are folded
into them where they are computed (:mod:`kaisa.core.folding`), and the running factors are
averaged in place (``allreduce``, written back into them; a tied weight's batch factors,
which are combined first, are averaged as batch factors). For a model FSDP2 shards, a Kronecker
block's batch factors are reduced (averaged) only to the ranks that decompose them
(``reduce``, fused into one bucket per destination), which alone keep its running
factors, so each rank's factor memory is about ``1/world`` of the total; diagonal blocks
(not placed, preconditioned on every rank) fold and are averaged on every rank. A held
block's average is handed out as soon as its collective finished (the core folds it then,
``BatchStatistics.fold_average``), so no rank keeps the batch factors until ``step()``.
:class:`FactorAverages` starts these collectives as layers finish their backward pass
and waits for them at its end; :class:`~kaisa.distributed.DistributedEngine` delegates to
it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.distributed.placement import Placement
from kaisa.distributed.protocol import CommHandle, Communicator
from kaisa.utils.enums import Side

__all__ = ["FactorAverages", "FactorPair"]

#: A block's averaged ``(A, G)`` batch factors (``None``: a side not recorded).
FactorPair = tuple[torch.Tensor | None, torch.Tensor | None]


class FactorAverages:
    """The factor collectives of one engine, and which ranks keep which running factors.

    Args:
        layers: The blocks, in model order (the same on every rank).
        comm: The communicator (its ``rank`` and ``world_size`` are this engine's).
        placement: The placement (who decomposes each Kronecker block).
        owned: Running factors on their owners only (a model FSDP2 shards).
        symmetry_aware: Send only the upper triangles of dense factors.
        waiting: Context that accounts the time blocked in ``wait()``.
    """

    def __init__(
        self,
        layers: Mapping[str, CurvatureBlock],
        comm: Communicator,
        placement: Placement,
        *,
        owned: bool,
        symmetry_aware: bool,
        waiting: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._layers = layers
        self._comm = comm
        self._placement = placement
        self._owned = owned
        self._sym = symmetry_aware
        self._waiting = waiting
        self._pending: dict[str, tuple[CommHandle | None, CommHandle | None]] = {}
        # This rank's reduces of the blocks it holds whose averages fold on arrival, in the
        # order they were started.
        self._arriving: dict[str, tuple[CommHandle | None, CommHandle | None]] = {}
        # Running factors folded in the hooks, averaged over ranks (every rank holds them).
        self._running: dict[str, tuple[CommHandle | None, CommHandle | None]] = {}
        # Reduces to other ranks that this rank contributes to (waited, results dropped).
        self._contributions: list[CommHandle] = []
        # The batch factors the step's collectives gave that are kept for step(), waited for
        # at the end of the backward pass (running factors are averaged in place, and the
        # averages that fold on arrival are handed out).
        self._averaged: dict[str, FactorPair] = {}
        # Blocks whose batch factors were sent in this step (once a step: a kind may keep
        # what it recorded until it is combined).
        self._sent: set[str] = set()

    def holders(self, name: str) -> tuple[int, ...]:
        """The ranks that keep block ``name``'s running factors.

        Every rank, except for a Kronecker block of a model FSDP2 shards: there the ranks
        that decompose its A or G factor (one rank with ``colocate_factors``) keep both
        (the damping of either side reads both).
        """
        placed = self._placement.layers.get(name)
        if placed is None or not self._owned:
            return tuple(range(self._comm.world_size))
        return tuple(sorted({placed.a_rank, placed.g_rank}))

    def layer_done(self, layer: CurvatureBlock) -> dict[str, FactorPair]:
        """Starts averaging ``layer``'s factors unless started or nothing recorded.

        The running factors of the sides folded in this step (``layer.stats.folded``,
        every rank holds them), else the batch factors recorded.

        Returns:
            :meth:`arrived`: the averages that came in meanwhile, to be folded now.
        """
        self._start(layer)
        return self.arrived()

    def _start(self, layer: CurvatureBlock) -> None:
        # Diagonal sides (scale-shift's G too) travel unpacked.
        sym_a, sym_g = (self._sym and not layer.is_diagonal(side) for side in (Side.A, Side.G))
        folded = layer.stats.folded
        if folded and layer.name not in self._running:
            f, comm = layer.factors, self._comm
            # A packed factor travels as it is kept: its triangles.
            run_a, run_g = sym_a and not f.is_packed(Side.A), sym_g and not f.is_packed(Side.G)
            self._running[layer.name] = (
                comm.allreduce_mean_(f.a, symmetric=run_a) if Side.A in folded and f.a is not None
                else None,
                comm.allreduce_mean_(f.g, symmetric=run_g) if Side.G in folded and f.g is not None
                else None,
            )
            folded.clear()
        if layer.name in self._sent or not layer.stats.has_factors:
            return
        self._sent.add(layer.name)
        a_batch, g_batch = layer.stats.take()
        holders = self.holders(layer.name)
        if len(holders) == self._comm.world_size:
            comm = self._comm
            self._pending[layer.name] = (
                None if a_batch is None else comm.allreduce_mean(a_batch, symmetric=sym_a),
                None if g_batch is None else comm.allreduce_mean(g_batch, symmetric=sym_g),
            )
            return
        mine = (self._reduce(a_batch, holders, sym_a), self._reduce(g_batch, holders, sym_g))
        if not layer.stats.fold_average:
            self._pending[layer.name] = mine
        elif mine != (None, None):  # this rank holds the block: fold the average on arrival
            self._arriving[layer.name] = mine

    def _reduce(self, batch: torch.Tensor | None, holders: tuple[int, ...], symmetric: bool,
                ) -> CommHandle | None:
        """Reduces ``batch`` to each of ``holders``; this rank's handle if it is one."""
        if batch is None:
            return None
        mine = None
        for dst in holders:
            handle = self._comm.reduce_mean(batch, dst, symmetric=symmetric, kind="factor_reduce")
            if dst == self._comm.rank:
                mine = handle
            else:
                self._contributions.append(handle)
        return mine

    def arrived(self) -> dict[str, FactorPair]:
        """The batch factor averages to fold as they arrive whose collectives finished.

        Those of the blocks whose statistics fold on arrival
        (:attr:`~kaisa.blocks.state.BatchStatistics.fold_average`: under FSDP2, a block
        whose running factors only some ranks hold), on a rank that holds them. They are
        no longer kept here.

        Returns:
            ``name -> (A, G)`` averaged batch factors (``None`` for a side not recorded).
        """
        out: dict[str, FactorPair] = {}
        # This rank's reduce buckets finish in the order they were started: the first entry
        # not finished ends the scan (a later one is handed out at the next call or at the
        # end of the backward pass).
        for name, (ha, hg) in list(self._arriving.items()):
            if not all(h is None or h.done for h in (ha, hg)):
                break
            del self._arriving[name]
            out[name] = (_result(ha), _result(hg))
        return out

    def backward_end(self) -> dict[str, FactorPair]:
        """Starts every remaining factor collective, launches all buckets, waits for them.

        After the backward pass nothing of the step's collectives is held beyond their
        results: the running factors averaged in place, the averages to fold on arrival
        (returned), and the batch factors this rank keeps for ``step()`` (a tied weight's,
        which are combined first). On a GPU the wait is a stream dependency, not a host
        wait; on the CPU ``step()`` would wait for them first.

        Returns:
            :meth:`arrived`: every average to fold now.
        """
        for layer in self._layers.values():
            self._start(layer)
        self._comm.flush()
        with self._waiting():
            for name, (ha, hg) in self._pending.items():
                self._averaged[name] = (_result(ha), _result(hg))
            arrivals = {name: (_result(ha), _result(hg))
                        for name, (ha, hg) in self._arriving.items()}
            for handles in self._running.values():  # written back into the running factors
                for handle in handles:
                    if handle is not None:
                        handle.wait()
            for handle in self._contributions:
                handle.wait()
        self._pending.clear()
        self._arriving.clear()
        self._running.clear()
        self._contributions.clear()
        return arrivals

    def wait(self) -> dict[str, FactorPair]:
        """Waits for every started factor collective (:meth:`backward_end`).

        Every rank that keeps a block's running factors (:meth:`holders`) gets the same
        averaged factors, so they stay identical there; the running factors folded in the
        step are averaged in place.

        Returns:
            ``name -> (A, G)`` batch factors averaged over ranks that are still to be
            folded (``None`` for a side not recorded, and on a rank that does not keep the
            block's factors), those that arrive now included.
        """
        arrivals = self.backward_end()
        averaged, self._averaged = self._averaged, {}
        self._sent.clear()
        return averaged | arrivals

    def drop(self) -> None:
        """Forgets the collectives started in an abandoned step (no step follows)."""
        self._pending.clear()
        self._arriving.clear()
        self._running.clear()
        self._contributions.clear()
        self._averaged.clear()
        self._sent.clear()


def _result(handle: CommHandle | None) -> torch.Tensor | None:
    """The result of a started collective (``None`` for a side not sent)."""
    return None if handle is None else handle.wait()
