"""The distributed side of a K-FAC step: grid, placement, communicator and collectives.

:class:`DistributedEngine` is built by :class:`kaisa.KFACPreconditioner` at every world
size: it resolves ``grad_worker_fraction`` (with the memory model for ``'auto'``) into a
:class:`~kaisa.distributed.strategy.WorkerGrid`, places the decompositions on ranks and
builds the communicator. When more than one rank takes part, the preconditioner calls it
at fixed points of a step:

* from the hooks (:meth:`~DistributedEngine.record_forward`,
  :meth:`~DistributedEngine.record_backward`): a layer's factor allreduce starts as soon
  as its last output gradient of the step is known, and every bucket is flushed at the
  end of the last backward pass;
* in the factor update (:meth:`~DistributedEngine.start_factor_allreduce`,
  :meth:`~DistributedEngine.averaged_factors`): batch factors are averaged over ranks
  before they are folded into the running factors;
* in the decomposition update (:meth:`~DistributedEngine.update_decompositions`): each
  rank decomposes its assigned factors and broadcasts them to the layer's gradient
  workers;
* in preconditioning (:meth:`~DistributedEngine.preconditioned_gradients`, only when
  some ranks are not gradient workers: MEM-OPT, HYBRID-OPT): the gradient workers
  broadcast the preconditioned gradients to the other ranks;
* at the end of the step (:meth:`~DistributedEngine.end_step`).

With one rank none of these is called and everything stays local.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
import torch.distributed as dist

from kaisa import linalg
from kaisa.distributed.comm import (
    CommHandle,
    LocalCommunicator,
    TorchDistCommunicator,
    make_communicator,
    pack_symmetric,
    unpack_symmetric,
)
from kaisa.distributed.memory import MemoryEstimate, choose_fraction, estimate_memory
from kaisa.distributed.placement import Placement, place_layers
from kaisa.distributed.strategy import WorkerGrid, resolve_grad_workers, valid_fractions
from kaisa.enums import ComputeMethod
from kaisa.linalg import EigenResult

if TYPE_CHECKING:
    from kaisa.arguments import KFACArguments
    from kaisa.layers import KFACLayer

__all__ = ["DistributedEngine", "PreconditionedGradient"]

logger = logging.getLogger("kaisa")

#: ``(layer, gradient, preconditioned gradient, validity flag or None)``.
PreconditionedGradient: TypeAlias = tuple[
    "KFACLayer", torch.Tensor, torch.Tensor, torch.Tensor | None
]

_Decomposition: TypeAlias = EigenResult | torch.Tensor | None


class DistributedEngine:
    """Distribution of the K-FAC work of one preconditioner over ranks.

    Args:
        layers: The registered layers, in model order (the same on every rank).
        args: The preconditioner's parsed arguments.
        timed: Context manager factory that adds the time spent in its block to the
            preconditioner's timing of the given phase (``'communication'``).

    Raises:
        ValueError: If ``grad_worker_fraction`` is not valid for the world size, or no
            fraction fits ``memory_budget_mb``.
    """

    def __init__(
        self,
        layers: Mapping[str, KFACLayer],
        args: KFACArguments,
        timed: Callable[[str], AbstractContextManager[None]],
    ) -> None:
        self._layers = layers
        self._args = args
        self._timed = timed
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        else:
            self._rank, self._world = 0, 1
        self._distributed = self._world > 1
        self._layer_dims = {name: _layer_dims(layer) for name, layer in layers.items()}
        # Factor dtype when ``factor_dtype`` is None: the weights', at least float32.
        factor_dtype = args.factor_dtype or torch.promote_types(
            next(iter(layers.values())).weight.dtype, torch.float32
        )
        self._memory_model: dict[str, Any] = {
            "compute_method": args.compute_method.value,
            "itemsize": torch.empty((), dtype=factor_dtype).element_size(),
            "inv_itemsize": torch.empty((), dtype=args.inv_dtype).element_size(),
            "outer_product": args.compute_eigenvalue_outer_product,
            "layer_groups": {name: layer.groups for name, layer in layers.items()},
            "assignment_strategy": args.assignment_strategy.value,
            "colocate_factors": args.colocate_factors,
        }
        self._grid = WorkerGrid(self._world, self._resolve_grad_workers())
        self._placement = place_layers(
            self._layer_dims, self._grid, args.assignment_strategy.value, args.colocate_factors
        )
        self._comm: LocalCommunicator | TorchDistCommunicator = make_communicator(
            self._grid.worker_groups() + self._grid.receiver_groups(),
            bucket_cap_mb=args.allreduce_bucket_cap_mb,
        )
        self._receiver_group = {
            w: self._grid.receiver_groups()[self._grid.receiver_group_of(w)]
            for w in range(self._world)
        }
        # Per-step bookkeeping of the asynchronous factor allreduce.
        self._forward_calls: dict[str, int] = {}
        self._grad_calls: dict[str, int] = {}
        self._micro_batches = 0
        self._callback_queued = False
        self._pending_factors: dict[str, tuple[CommHandle | None, CommHandle | None]] = {}
        if self._distributed and self._rank == 0:
            logger.log(args.loglevel, "%s", self._placement.describe())

    def _resolve_grad_workers(self) -> int:
        """Gradient workers per layer for ``grad_worker_fraction`` at this world size."""
        args = self._args
        if args.grad_worker_fraction == "auto":
            assert args.memory_budget_mb is not None
            estimate = choose_fraction(
                self._layer_dims,
                self._world,
                float(args.memory_budget_mb),
                **self._memory_model,
            )
            logger.log(
                args.loglevel,
                "kaisa: grad_worker_fraction='auto' chose %s (modelled peak %.3f MB <= %s MB)",
                estimate.fraction,
                estimate.max_total_mb,
                args.memory_budget_mb,
            )
            return int(estimate.fraction * self._world)
        try:
            return resolve_grad_workers(args.grad_worker_fraction, self._world)
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
    def distributed(self) -> bool:
        """Whether more than one rank takes part."""
        return self._distributed

    @property
    def grid(self) -> WorkerGrid:
        """The gradient-worker grid."""
        return self._grid

    @property
    def placement(self) -> Placement:
        """Which rank computes and broadcasts each layer's decompositions and gradient."""
        return self._placement

    @property
    def communicator(self) -> LocalCommunicator | TorchDistCommunicator:
        """The communicator."""
        return self._comm

    @property
    def broadcasts_gradients(self) -> bool:
        """Whether some ranks receive preconditioned gradients (MEM-OPT, HYBRID-OPT)."""
        return self._distributed and self._grid.grad_workers < self._world

    def is_grad_worker(self, name: str) -> bool:
        """Whether this rank keeps the decompositions of layer ``name``."""
        return self._placement[name].is_grad_worker(self._rank)

    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank K-FAC memory for every valid ``grad_worker_fraction``.

        Returns:
            ``fraction -> estimate``, largest fraction first.
        """
        return {
            f: estimate_memory(
                self._layer_dims,
                WorkerGrid(self._world, int(f * self._world)),
                **self._memory_model,
            )
            for f in valid_fractions(self._world)
        }

    # ------------------------------------------------------------------ factors
    def record_forward(self, layer: KFACLayer) -> None:
        """Counts a recorded forward call of ``layer`` (one G is expected for each)."""
        self._forward_calls[layer.name] = self._forward_calls.get(layer.name, 0) + 1

    def record_backward(self, layer: KFACLayer) -> None:
        """Launches a layer's factor allreduce once its last G of the step is ready.

        The first call of a backward pass queues the end-of-backward flush.
        """
        name = layer.name
        self._grad_calls[name] = self._grad_calls.get(name, 0) + 1
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if (
            self._micro_batches == self._args.accumulation_steps - 1
            and self._grad_calls[name] == self._forward_calls.get(name, 0)
            and name not in self._pending_factors
        ):
            self._launch_factor_allreduce(layer)

    def _on_backward_end(self) -> None:
        """End of a backward pass: after the last micro-batch, flush every bucket."""
        self._callback_queued = False
        self._micro_batches += 1
        if self._micro_batches >= self._args.accumulation_steps:
            for layer in self._layers.values():
                self.start_factor_allreduce(layer)
            self._comm.flush()

    def start_factor_allreduce(self, layer: KFACLayer) -> None:
        """Starts averaging ``layer``'s batch factors unless started or nothing recorded."""
        if layer.name not in self._pending_factors and (
            layer.a_sum is not None or layer.g_sum is not None
        ):
            self._launch_factor_allreduce(layer)

    def _launch_factor_allreduce(self, layer: KFACLayer) -> None:
        """Starts the averaging of a layer's batch factors over ranks."""
        a_batch, g_batch = layer.take_batch_factors()
        sym = self._args.symmetry_aware
        self._pending_factors[layer.name] = (
            None if a_batch is None else self._comm.allreduce_mean(a_batch, symmetric=sym),
            None if g_batch is None else self._comm.allreduce_mean(g_batch, symmetric=sym),
        )

    def averaged_factors(
        self,
    ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Waits for every started factor allreduce.

        Every rank folds the same averaged batch factors, so the running factors (and
        the non-finite skips) stay identical on all ranks.

        Returns:
            ``name -> (A, G)`` batch factors averaged over ranks, for the layers whose
            allreduce was started.
        """
        self._comm.flush()
        with self._timed("communication"):
            averaged = {
                name: (
                    None if ha is None else ha.wait(),
                    None if hg is None else hg.wait(),
                )
                for name, (ha, hg) in self._pending_factors.items()
            }
        self._pending_factors.clear()
        return averaged

    def end_step(self) -> None:
        """Resets the per-step bookkeeping of the hooks."""
        self._forward_calls.clear()
        self._grad_calls.clear()
        self._micro_batches = 0

    # ------------------------------------------------------------------ decompositions
    def update_decompositions(self, damping: float) -> None:
        """Decomposes this rank's assigned factors and broadcasts them to grad workers.

        A failed decomposition keeps the previous one on every gradient worker: the
        source sends its previous result (or NaNs when there is none, which receivers
        treat as "no decomposition").

        Args:
            damping: The current damping.
        """
        layers = [la for la in self._layers.values() if la.a is not None and la.g is not None]
        if not layers:
            return
        rank = self._rank
        eigen = self._args.compute_method is ComputeMethod.EIGEN
        computed = self._decompose_assigned(layers, damping)
        sym = self._args.symmetry_aware
        pending: list[tuple[KFACLayer, str, int, list[CommHandle]]] = []
        for la in layers:
            lp = self._placement[la.name]
            if rank not in lp.grad_workers:
                continue
            for which, src in (("A", lp.a_rank), ("G", lp.g_rank)):
                factor = la.a if which == "A" else la.g
                assert factor is not None
                tensors = self._decomposition_payload(la, which, factor, src, computed)
                handles = []
                for i, t in enumerate(tensors):
                    symmetric = sym and not eigen and i == 0
                    handles.append(
                        self._comm.broadcast(t, src, lp.grad_workers, symmetric=symmetric)
                    )
                pending.append((la, which, src, handles))
        self._comm.flush()
        received: dict[tuple[str, str], _Decomposition] = {}
        with self._timed("communication"):
            for la, which, src, handles in pending:
                got = [h.wait() for h in handles]
                if src == rank:
                    received[(la.name, which)] = computed[(la.name, which)]
                elif not bool(torch.isfinite(got[0]).all()):
                    received[(la.name, which)] = None
                elif eigen:
                    received[(la.name, which)] = EigenResult(
                        eigenvalues=got[1], eigenvectors=got[0]
                    )
                else:
                    received[(la.name, which)] = got[0]
        outer = damping if self._args.compute_eigenvalue_outer_product else None
        for la in layers:
            if (la.name, "A") not in received:
                continue
            a_res, g_res = received[(la.name, "A")], received[(la.name, "G")]
            if eigen:
                assert not isinstance(a_res, torch.Tensor)
                assert not isinstance(g_res, torch.Tensor)
                la.set_eigen(a_res, g_res, damping=outer)
            else:
                assert not isinstance(a_res, EigenResult)
                assert not isinstance(g_res, EigenResult)
                la.set_inverses(a_res, g_res)

    def _decompose_assigned(
        self, layers: list[KFACLayer], damping: float
    ) -> dict[tuple[str, str], _Decomposition]:
        """Decomposes the factors the placement assigns to this rank.

        Returns:
            ``(layer, 'A' | 'G') -> result`` (``None`` for a failed decomposition).
        """
        args = self._args
        mine: list[tuple[KFACLayer, str]] = []
        for la in layers:
            lp = self._placement[la.name]
            if lp.a_rank == self._rank:
                mine.append((la, "A"))
            if lp.g_rank == self._rank:
                mine.append((la, "G"))
        computed: dict[tuple[str, str], _Decomposition] = {}
        if not mine:
            return computed
        mats = [la.a if which == "A" else la.g for la, which in mine]
        names = [f"{la.name}.{which}" for la, which in mine]
        results: list[Any]
        if args.compute_method is ComputeMethod.EIGEN:
            results = linalg.eigen_decompositions(mats, inv_dtype=args.inv_dtype, names=names)
        else:
            results = linalg.damped_inverses(
                mats, damping=damping, inv_dtype=args.inv_dtype, names=names
            )
        for (la, which), res in zip(mine, results, strict=True):
            # Keep exactly what the receivers rebuild (same values, contiguous
            # layout: matmul rounding depends on strides), so every gradient
            # worker preconditions bit for bit alike.
            if isinstance(res, torch.Tensor):
                if args.symmetry_aware:
                    res = unpack_symmetric(pack_symmetric(res), res.shape[-1])
                res = res.contiguous()
            elif isinstance(res, EigenResult):
                res = EigenResult(res.eigenvalues.contiguous(), res.eigenvectors.contiguous())
            computed[(la.name, which)] = res
        return computed

    def _decomposition_payload(
        self,
        layer: KFACLayer,
        which: str,
        factor: torch.Tensor,
        src: int,
        computed: dict[tuple[str, str], _Decomposition],
    ) -> list[torch.Tensor]:
        """Tensors broadcast for one factor: the data on ``src``, buffers elsewhere."""
        eigen = self._args.compute_method is ComputeMethod.EIGEN
        blocks, n = factor.shape[0], factor.shape[-1]
        dtype, device = self._args.inv_dtype, factor.device
        if src != self._rank:
            if eigen:
                return [
                    torch.empty((blocks, n, n), dtype=dtype, device=device),
                    torch.empty((blocks, n), dtype=dtype, device=device),
                ]
            return [torch.empty((blocks, n, n), dtype=dtype, device=device)]
        res = computed[(layer.name, which)]
        if eigen:
            if isinstance(res, EigenResult):
                return [res.eigenvectors, res.eigenvalues]
            q, d = (layer.qa, layer.da) if which == "A" else (layer.qg, layer.dg)
            if q is not None and d is not None:
                return [q, d]
            nan = float("nan")
            return [
                torch.full((blocks, n, n), nan, dtype=dtype, device=device),
                torch.full((blocks, n), nan, dtype=dtype, device=device),
            ]
        if isinstance(res, torch.Tensor):
            return [res]
        prev = layer.a_inv if which == "A" else layer.g_inv
        if prev is not None:
            return [prev]
        return [torch.full((blocks, n, n), float("nan"), dtype=dtype, device=device)]

    # ------------------------------------------------------------------ gradients
    def preconditioned_gradients(self, damping: float) -> list[PreconditionedGradient]:
        """Preconditioned gradients on every rank when some ranks are not grad workers.

        Grad workers precondition and broadcast ``[P.flatten(), valid]`` to the other
        ranks of their receiver group; every rank then holds every layer's result.

        Args:
            damping: The current damping.

        Returns:
            One entry per layer with a gradient, in model order.
        """
        rank = self._rank
        entries: list[tuple[KFACLayer, torch.Tensor, torch.Tensor, CommHandle | None]] = []
        for layer in self._layers.values():
            grad = layer.grad_matrix()
            if grad is None:
                continue
            lp = self._placement[layer.name]
            if rank in lp.grad_workers:
                precond = layer.precondition(grad, damping) if layer.has_decomposition() else None
                buf = grad.new_zeros(grad.numel() + 1)
                if precond is not None:
                    buf[:-1].copy_(precond.reshape(-1))
                    buf[-1] = 1.0
                handle = None
                if lp.grad_receivers[rank]:
                    handle = self._comm.broadcast(
                        buf, rank, self._receiver_group[rank], kind="gradients"
                    )
                entries.append((layer, grad, buf, handle))
            else:
                src = lp.grad_source(rank)
                buf = grad.new_empty(grad.numel() + 1)
                handle = self._comm.broadcast(buf, src, self._receiver_group[src], kind="gradients")
                entries.append((layer, grad, buf, handle))
        self._comm.flush()
        out: list[PreconditionedGradient] = []
        with self._timed("communication"):
            for layer, grad, buf, handle in entries:
                if handle is not None:
                    handle.wait()
                out.append((layer, grad, buf[:-1].view_as(grad), buf[-1] > 0))
        return out

    # ------------------------------------------------------------------ checkpoints
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one blocking allreduce).

        Args:
            flag: This rank's value.

        Returns:
            The logical or over ranks.
        """
        value = torch.tensor([1.0 if flag else 0.0])
        return bool(self._comm.allreduce_mean(value, kind="control").wait()[0] > 0)


def _layer_dims(layer: KFACLayer) -> tuple[int, int]:
    """``(a_dim, g_dim)`` of one Kronecker block of a registered layer."""
    weight = layer.weight
    g_dim = weight.shape[0] // layer.groups
    a_dim = weight[0].numel() + (1 if layer.has_bias else 0)
    return a_dim, g_dim
