"""The distribution of a K-FAC step over ranks: grid, placement and the collectives.

:class:`DistributedEngine` is the one path of every step at every world size; with one
rank the placement puts everything on rank 0 and the communicator is local, so the same
code runs with no communication. At fixed points of a step it

* averages each layer's running factors (folded where the statistics are computed) or
  batch factors over ranks (:meth:`~DistributedEngine.layer_done` starts a layer's
  allreduce as soon as its statistics are complete, during the backward pass;
  :meth:`~DistributedEngine.averaged_factors` waits for all of them; running factors
  are averaged in place);
* decomposes the factors the placement assigns to this rank and broadcasts the
  results to each layer's gradient workers (:meth:`~DistributedEngine.update_decompositions`);
* has the gradient workers precondition (or run a product's per-block rule, which may
  keep state with the block's decompositions: :meth:`~DistributedEngine.transform`) and,
  where some ranks are not gradient workers (MEM-OPT, HYBRID-OPT), broadcast the results
  (:meth:`~DistributedEngine.precondition`); for a block FSDP2 shards, gathers its
  gradient to its workers only and sends each rank only its rows
  (:meth:`~DistributedEngine.sharded`, :mod:`kaisa.distributed.fsdp`).

It moves payloads; the math is the second-order method's
(:class:`~kaisa.methods.SecondOrderMethod`), the statistics are the hooks'
(:mod:`kaisa.core.hooks`). A block's diagonal sides
(:attr:`~kaisa.blocks.CurvatureBlock.diagonal_sides`) travel as vectors (never packed as
triangles), and the method is told which sides are diagonal at every call.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Collection, Mapping, MutableMapping
from contextlib import AbstractContextManager
from fractions import Fraction
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from kaisa.blocks import CurvatureBlock, Preconditioned
from kaisa.distributed.averaging import FactorAverages, FactorPair
from kaisa.distributed.config import EngineConfig
from kaisa.distributed.decompose import FactorKey, decompose_assigned, has_factors, payload
from kaisa.distributed.fsdp import ShardedBlocks
from kaisa.distributed.memory import (
    FactorSize,
    MemoryEstimate,
    choose_fraction,
    estimate_memory,
    factor_sizes,
)
from kaisa.distributed.placement import Placement, place_layers
from kaisa.distributed.protocol import CommHandle, Communicator
from kaisa.distributed.strategy import WorkerGrid, resolve_grad_workers, valid_fractions
from kaisa.distributed.torch_comm import make_communicator
from kaisa.methods import Payload, SecondOrderMethod
from kaisa.utils.enums import Side
from kaisa.utils.finite import all_finite
from kaisa.utils.profiling import timed

__all__ = ["BlockRule", "DistributedEngine"]

logger = logging.getLogger("kaisa")

#: What a block's gradient workers compute from its gradient matrix
#: (:meth:`DistributedEngine.transform`): a matrix of its shape, or ``None``.
BlockRule: TypeAlias = Callable[[CurvatureBlock, torch.Tensor], torch.Tensor | None]


class DistributedEngine:
    """Distribution of the K-FAC work of one preconditioner over ranks.

    Args:
        layers: The curvature blocks, in model order (the same on every rank).
        config: The distributed configuration.
        method: The second-order method.
        communicator: The communicator; by default a
            :class:`~kaisa.distributed.TorchDistCommunicator` when ``torch.distributed``
            runs more than one rank, else a local one. Its ``rank`` and ``world_size``
            define this engine's (tests pass fakes).
        timings: Seconds by phase; waits add to ``'communication'``.

    Raises:
        ValueError: If ``grad_worker_fraction`` is not valid for the world size, or no
            fraction fits ``memory_budget_mb``.
    """

    def __init__(
        self,
        layers: Mapping[str, CurvatureBlock],
        config: EngineConfig,
        method: SecondOrderMethod,
        *,
        communicator: Communicator | None = None,
        timings: MutableMapping[str, float] | None = None,
    ) -> None:
        self._layers = layers
        self._config = config
        self._method = method
        self._timings = timings if timings is not None else {"communication": 0.0}
        if communicator is not None:
            self._rank, self._world = communicator.rank, communicator.world_size
        elif dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        else:
            self._rank, self._world = 0, 1
        # Kronecker blocks are placed; diagonal blocks (statistics averaged like factors,
        # preconditioned on every rank by the core) have no decomposition to place.
        kron = {name: layer for name, layer in layers.items() if not layer.diagonal}
        self._layer_dims = {name: layer.dims for name, layer in kron.items()}
        # What the memory model needs besides the grid (placement and sizes use it too).
        self._sizes: dict[str, Any] = {
            "method": method,
            "itemsize": config.factor_dtype.itemsize,
            "inv_itemsize": config.inv_dtype.itemsize,
            "layer_groups": {name: layer.groups for name, layer in kron.items()},
            "diagonal_sides": {name: layer.diagonal_sides for name, layer in kron.items()},
            "packed": config.packed_factors,
        }
        # Under FSDP2 / HSDP a Kronecker block's running factors live on the ranks that
        # decompose it only (its batch factors are reduced to them); else on every rank.
        self._owned_factors = any(layer.sharded() for layer in layers.values())
        self._grid = WorkerGrid(self._world, self._resolve_grad_workers())
        self._placement = place_layers(
            self._layer_dims, self._grid, config.assignment_strategy, config.colocate_factors,
            self._sizes["diagonal_sides"],
        )
        timeout = config.collective_timeout
        self._comm: Communicator = communicator or make_communicator(
            self._grid.worker_groups() + self._grid.receiver_groups(),
            bucket_cap_mb=config.allreduce_bucket_cap_mb,
            timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
        )
        receivers = self._grid.receiver_groups()
        self._receiver_group = {
            w: receivers[self._grid.receiver_group_of(w)] for w in range(self._world)
        }
        self._factors = FactorAverages(
            layers, self._comm, self._placement, owned=self._owned_factors,
            symmetry_aware=config.symmetry_aware, waiting=self._waiting)
        self._sharded = ShardedBlocks(self._comm, self._placement, self._waiting)
        if self._world > 1 and self._rank == 0:
            logger.log(config.loglevel, "%s", self._placement.describe())

    def _memory_model(self, grid: WorkerGrid) -> MemoryEstimate:
        cfg = self._config
        return estimate_memory(
            self._layer_dims,
            grid,
            assignment_strategy=cfg.assignment_strategy,
            colocate_factors=cfg.colocate_factors,
            owned_factors=self._owned_factors,
            **self._sizes,
        )

    def _resolve_grad_workers(self) -> int:
        """Gradient workers per layer for ``grad_worker_fraction`` at this world size."""
        cfg = self._config
        if cfg.grad_worker_fraction == "auto":
            model = cfg.cost_model
            assert cfg.memory_budget_mb is not None or model is not None
            cost = None if model is None else (
                lambda est: model(est.placement, layer_groups=self._sizes["layer_groups"],
                                  diagonal_sides=self._sizes["diagonal_sides"]))
            estimate = choose_fraction(
                self._layer_dims,
                self._world,
                None if cfg.memory_budget_mb is None else float(cfg.memory_budget_mb),
                estimate=self._memory_model,
                cost=cost,
            )
            logger.log(
                cfg.loglevel,
                "kaisa: grad_worker_fraction='auto' chose %s by %s (modelled peak %.3f MB, "
                "budget %s MB)",
                estimate.fraction,
                "the time objective" if model is not None else "the memory rule",
                estimate.max_total_mb,
                cfg.memory_budget_mb,
            )
            return int(estimate.fraction * self._world)
        try:
            return resolve_grad_workers(cfg.grad_worker_fraction, self._world)
        except (TypeError, ValueError) as err:
            raise ValueError(str(err)) from None

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """This process's rank (0 without torch.distributed)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the K-FAC work (1 without torch.distributed)."""
        return self._world

    @property
    def grid(self) -> WorkerGrid:
        """The gradient-worker grid."""
        return self._grid

    @property
    def placement(self) -> Placement:
        """Which rank computes and broadcasts each layer's decompositions and gradient."""
        return self._placement

    @property
    def communicator(self) -> Communicator:
        """The communicator."""
        return self._comm

    def is_grad_worker(self, name: str) -> bool:
        """Whether this rank keeps the decompositions of layer ``name``.

        Every rank keeps a diagonal block's state (it is not placed).
        """
        placed = self._placement.layers.get(name)
        return placed is None or placed.is_grad_worker(self._rank)

    def local_worker(self, name: str) -> bool:
        """Whether this rank preconditions block ``name`` and sends the result to no rank."""
        placed = self._placement.layers.get(name)
        return (placed is not None and self._rank in placed.grad_workers
                and not placed.grad_receivers[self._rank])

    @property
    def owned_factors(self) -> bool:
        """Whether running factors live on their owners only (a model FSDP2 shards)."""
        return self._owned_factors

    def factor_holders(self, name: str) -> tuple[int, ...]:
        """The ranks that keep block ``name``'s running factors (:meth:`FactorAverages.holders`)."""
        return self._factors.holders(name)

    def holds_factors(self, name: str) -> bool:
        """Whether this rank keeps block ``name``'s running factors."""
        return self._rank in self.factor_holders(name)

    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank K-FAC memory for every valid ``grad_worker_fraction``.

        Returns:
            ``fraction -> estimate``, largest fraction first.
        """
        return {
            f: self._memory_model(WorkerGrid(self._world, int(f * self._world)))
            for f in valid_fractions(self._world)
        }

    def factor_sizes(self) -> list[FactorSize]:
        """Every factor's memory and decomposition cost, largest first."""
        return factor_sizes(self._layer_dims, **self._sizes)

    # ------------------------------------------------------------------ factors
    def layer_done(self, layer: CurvatureBlock) -> dict[str, FactorPair]:
        """Starts averaging ``layer``'s factors (:meth:`FactorAverages.layer_done`).

        Returns:
            The averages to fold on arrival that came in meanwhile.
        """
        return self._factors.layer_done(layer)

    def backward_end(self) -> dict[str, FactorPair]:
        """Starts and waits for the remaining factor collectives (``FactorAverages``).

        Returns:
            Every average to fold on arrival not handed out yet.
        """
        return self._factors.backward_end()

    def averaged_factors(self) -> dict[str, FactorPair]:
        """Waits for every started factor collective (:meth:`FactorAverages.wait`).

        Returns:
            ``name -> (A, G)`` batch factors averaged over ranks (``None`` for a side
            not recorded, and on a rank that does not keep the block's factors).
        """
        return self._factors.wait()

    def drop_pending(self) -> None:
        """Forgets the factor averages started in an abandoned step (no step follows)."""
        self._factors.drop()

    # ------------------------------------------------------------------ decompositions
    def update_decompositions(
        self, damping: float, *, warm_start: bool = False,
        blocks: Collection[str] | None = None,
    ) -> None:
        """Decomposes this rank's assigned factors and broadcasts them to grad workers.

        A failed decomposition keeps the previous one on every gradient worker: the
        source sends its previous result (or NaNs when there is none, which receivers
        treat as "no result").

        Args:
            damping: The current damping.
            warm_start: Give the method each factor's stored payload (the source is a
                gradient worker, so it holds it) to start from
                (:meth:`~kaisa.methods.SecondOrderMethod.refresh_dense`).
            blocks: The names of the blocks to decompose (every rank gives the same);
                ``None``: every block.
        """
        if self._owned_factors:  # only the owners know whether a block has factors
            layers = [la for la in self._layers.values() if not la.diagonal]
        else:
            layers = [la for la in self._layers.values() if has_factors(la, self._method)]
        if blocks is not None:
            layers = [la for la in layers if la.name in blocks]
        if not layers:
            return
        computed = decompose_assigned(
            layers, damping, placement=self._placement, rank=self._rank, method=self._method,
            config=self._config, warm_start=warm_start,
        )
        sym = self._config.symmetry_aware
        pending: list[tuple[CurvatureBlock, Side, int, list[CommHandle]]] = []
        for la in layers:
            lp = self._placement[la.name]
            if self._rank not in lp.grad_workers:
                continue
            for side, src in ((Side.A, lp.a_rank), (Side.G, lp.g_rank)):
                if side not in self._method.sides:
                    continue
                tensors = payload(la, side, src=src, rank=self._rank, method=self._method,
                                  inv_dtype=self._config.inv_dtype, computed=computed)
                flags = self._method.payload_symmetric(diagonal=la.is_diagonal(side))
                handles = [
                    self._comm.broadcast(t, src, lp.grad_workers, symmetric=sym and flag)
                    for t, flag in zip(tensors, flags, strict=True)
                ]
                pending.append((la, side, src, handles))
        self._comm.flush()
        received: dict[FactorKey, Payload | None] = {}
        with self._waiting():
            for la, side, src, handles in pending:
                got = [h.wait() for h in handles]
                if src == self._rank:
                    received[(la.name, side)] = computed[(la.name, side)]
                elif not bool(all_finite(got[0])):
                    received[(la.name, side)] = None  # the source had no result either
                else:
                    received[(la.name, side)] = got
        for la in layers:
            if (la.name, Side.A) in received:
                self._method.install(
                    la.decomposition, received[(la.name, Side.A)],
                    received.get((la.name, Side.G)),
                    damping=damping, diagonal=la.diagonal_sides,
                )

    # ------------------------------------------------------------------ gradients
    def sharded(
        self, block: CurvatureBlock, rule: BlockRule,
        grads: Mapping[torch.Tensor, torch.Tensor] | None = None,
    ) -> list[Preconditioned]:
        """A block FSDP2 shards through ``rule``, each rank getting only its rows.

        Its full gradient is assembled on its gradient workers only; see
        :class:`kaisa.distributed.fsdp.ShardedBlocks` (every rank calls it for the same
        blocks in the same order).

        Args:
            block: The block (its parameters ``DTensor`` objects).
            rule: The per-block computation (:meth:`preconditioning` or a product's).
            grads: ``parameter -> gradient``; by default the parameters' ``.grad``.

        Returns:
            The block's entry, this rank's rows (or none).
        """
        return self._sharded.transform(block, rule, grads)

    def preconditioning(self, damping: float) -> BlockRule:
        """The method's preconditioning at ``damping``, as a block rule."""
        method = self._method
        return lambda layer, grad: method.precondition(
            layer.decomposition, grad, damping, diagonal=layer.diagonal_sides)

    def precondition(
        self, gradients: Mapping[str, torch.Tensor], damping: float
    ) -> list[Preconditioned]:
        """:meth:`transform` with the method's preconditioning at ``damping``."""
        return self.transform(gradients, self.preconditioning(damping))

    def transform(
        self, gradients: Mapping[str, torch.Tensor], rule: BlockRule
    ) -> list[Preconditioned]:
        """Every block's gradient matrix through ``rule``, on every rank.

        Gradient workers call ``rule(block, grad)`` (it may update the block's
        ``decomposition``, which only they hold); where a block has receivers (ranks that
        are not its gradient workers), its worker broadcasts ``[result.flatten(), valid]``
        to them (``valid`` 0 when the rule gave ``None``).

        Args:
            gradients: ``name -> gradient matrix`` of the blocks that have one (the same
                on every rank).
            rule: The per-block computation (a result of the gradient's shape).

        Returns:
            One entry per block with a gradient and a result, in model order.
        """
        rank = self._rank
        # Model order: a finished entry, or (block, grad, buffer, handle) to wait for.
        slots: list[Preconditioned | tuple[CurvatureBlock, torch.Tensor, torch.Tensor,
                                           CommHandle]] = []
        waiting = False
        for layer in self._layers.values():
            grad = gradients.get(layer.name)
            if grad is None:
                continue
            lp = self._placement[layer.name]
            if rank in lp.grad_workers:
                precond = rule(layer, grad)
                if not lp.grad_receivers[rank]:
                    if precond is not None:
                        slots.append(Preconditioned(layer, grad, precond))
                    continue
                buf = grad.new_zeros(grad.numel() + 1)
                if precond is not None:
                    buf[:-1].copy_(precond.reshape(-1))
                    buf[-1] = 1.0
                handle = self._comm.broadcast(
                    buf, rank, self._receiver_group[rank], kind="gradients"
                )
            else:
                src = lp.grad_source(rank)
                buf = grad.new_empty(grad.numel() + 1)
                handle = self._comm.broadcast(buf, src, self._receiver_group[src], kind="gradients")
            slots.append((layer, grad, buf, handle))
            waiting = True
        if not waiting:
            return slots  # type: ignore[return-value]
        self._comm.flush()
        out: list[Preconditioned] = []
        with self._waiting():
            for slot in slots:
                if isinstance(slot, Preconditioned):
                    out.append(slot)
                    continue
                layer, grad, t, handle = slot
                handle.wait()
                out.append(Preconditioned(layer, grad, t[:-1].view_as(grad), t[-1] > 0))
        return out

    # ------------------------------------------------------------------ control
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one blocking allreduce).

        Args:
            flag: This rank's value.

        Returns:
            The logical or over ranks.
        """
        if self._world == 1:
            return flag
        device = next(iter(self._layers.values())).weight.device  # NCCL needs CUDA tensors
        value = torch.tensor([1.0 if flag else 0.0], device=device)
        return bool(self.mean_over_ranks(value)[0] > 0)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of a few control scalars (blocking; itself with one rank).

        Args:
            values: This rank's values, on the blocks' device (NCCL needs CUDA tensors).

        Returns:
            The mean.
        """
        if self._world == 1:
            return values
        return self._comm.allreduce_mean(values, kind="control").wait()

    def _waiting(self) -> AbstractContextManager[None]:
        """Adds the seconds spent in the block to the ``'communication'`` timing."""
        return timed(self._timings, "communication")
