"""Per-rank K-FAC memory model and the ``grad_worker_fraction='auto'`` choice.

The model counts, for every rank, the bytes of

* ``factors``: the running A and G factors (``n`` elements for a diagonal factor,
  ``n^2`` for a dense one); with DDP every rank keeps all of them (the factor
  allreduce); under FSDP2 (``owned_factors``) only the ranks that decompose a layer's
  factors keep them (they are reduced to those ranks), about ``1/world`` each;
* ``decompositions``: eigenvectors and eigenvalues (``'eigen'``) or inverses
  (``'inverse'``) of the layers for which the rank is a gradient worker;
* ``buffers``: what else exists at the end of a factor step's backward pass: nothing (the
  statistics are folded into the running factors where they are computed,
  ``docs/conventions.md``, and the running factors are averaged in place by the end of the
  backward pass; under FSDP2 a block's batch factors are reduced to the ranks that hold it,
  which fold the average as it arrives; during the backward pass at most two buckets'
  copies are in flight, ``allreduce_bucket_cap_mb`` each, none for a factor alone in its
  bucket);
* ``step_buffers``: what else exists at the peak inside ``step()``
  (:mod:`kaisa.distributed.step_buffers`): the preconditioned gradients of every layer
  before they are written back, with the copies the rank's path keeps (grouped, per block
  with the broadcast buffers it sends or receives, or FSDP2's rows);
* ``total``: ``factors + decompositions + max(buffers, step_buffers)``, the larger of the
  two moments.

A tied weight's batch factors (combined over its uses) are folded at the start of
``step()``; the model leaves them out (it does not know which weights are tied).

The decomposition bytes follow the placement computed by
:func:`kaisa.distributed.placement.place_layers`, so the estimate is per rank
and the maximum over ranks is what must fit the budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol

from kaisa.blocks.state import LARGE_FACTOR_DIM
from kaisa.distributed.placement import LayerPlacement, Placement, place_layers
from kaisa.distributed.step_buffers import StepLayer, StepPath, step_buffer_numel
from kaisa.distributed.strategy import WorkerGrid, valid_fractions
from kaisa.methods import DENSE, Diagonal, SecondOrderMethod, make_method
from kaisa.utils.enums import AssignmentStrategy, ComputeMethod, Side, parse_enum

__all__ = [
    "LARGE_FACTOR_DIM",
    "FactorSize",
    "FractionCost",
    "MemoryEstimate",
    "choose_fraction",
    "decomposition_numel",
    "estimate_memory",
    "factor_sizes",
    "large_factor_message",
]

_MB = 1024 * 1024

@dataclass(frozen=True)
class FactorSize:
    """The cost of one Kronecker factor of one layer.

    Attributes:
        layer: The layer name.
        side: Which factor.
        dim: The factor dimension ``n``.
        blocks: Kronecker blocks (convolution groups).
        nbytes: Bytes of the running factor, the batch factor and the decomposition.
        gflop: Billions of floating-point operations per decomposition.
        diagonal: Whether the factor is kept as its diagonal.
    """

    layer: str
    side: Side
    dim: int
    blocks: int
    nbytes: int
    gflop: float
    diagonal: bool = False


def _factor_numel(n: int, diagonal: bool, packed: bool = False) -> int:
    """Elements of one running (or batch) factor block (``packed``: its upper triangle)."""
    return n if diagonal else n * (n + 1) // 2 if packed else n * n


def factor_sizes(
    layer_dims: Mapping[str, tuple[int, int]],
    *,
    method: SecondOrderMethod,
    itemsize: int = 4,
    inv_itemsize: int = 4,
    layer_groups: Mapping[str, int] | None = None,
    diagonal_sides: Mapping[str, Diagonal] | None = None,
    packed: bool = False,
) -> list[FactorSize]:
    """Every factor's memory and decomposition cost, largest first.

    Args:
        layer_dims: ``name -> (a_dim, g_dim)``.
        method: The second-order method (its per-factor storage and cost).
        itemsize: Bytes per factor element.
        inv_itemsize: Bytes per decomposition element.
        layer_groups: Kronecker blocks per layer (default 1).
        diagonal_sides: The sides each layer keeps as diagonals (default none).
        packed: Running factors kept as upper triangles (the batch factor stays dense).

    Returns:
        One entry per factor, sorted by dimension, largest first.
    """
    groups = dict(layer_groups or {})
    diagonal = dict(diagonal_sides or {})
    out = []
    for name, (a_dim, g_dim) in layer_dims.items():
        blocks = groups.get(name, 1)
        for side, n in ((Side.A, a_dim), (Side.G, g_dim)):
            diag = side in diagonal.get(name, DENSE)
            # one side's decomposition: as the A side of a block with an empty G side
            stored = method.numel(n, 0, diagonal=frozenset({Side.A}) if diag else DENSE)
            per_block = ((_factor_numel(n, diag, packed) + _factor_numel(n, diag)) * itemsize
                         + stored * inv_itemsize)
            gflop = blocks * method.decompose_flops(n, diagonal=diag) / 1e9
            out.append(FactorSize(name, side, n, blocks, blocks * per_block, gflop, diag))
    return sorted(out, key=lambda f: (-f.dim, f.layer, f.side.value))


def decomposition_numel(
    a_dim: int, g_dim: int, compute_method: ComputeMethod | str, outer_product: bool = True
) -> int:
    """Elements of one layer's decompositions (one Kronecker block).

    Args:
        a_dim: A factor dimension.
        g_dim: G factor dimension.
        compute_method: The method (or its name); its ``numel`` is the model.
        outer_product: Eigen: whether the eigenvalue outer product is stored.

    Returns:
        Number of elements.
    """
    kind = parse_enum(ComputeMethod, compute_method, "compute_method")
    return make_method(kind, outer_product=outer_product).numel(a_dim, g_dim)


@dataclass(frozen=True)
class MemoryEstimate:
    """Modelled K-FAC memory for one gradient-worker fraction.

    Attributes:
        fraction: The gradient-worker fraction.
        placement: The placement the estimate is based on.
        per_rank: Bytes by kind (``factors``, ``decompositions``, ``buffers`` after the
            backward pass, ``step_buffers`` at the peak of ``step()``, and ``total``, the
            larger moment's sum) for every rank.
    """

    fraction: Fraction
    placement: Placement
    per_rank: tuple[dict[str, int], ...]

    @property
    def max_total(self) -> int:
        """The largest per-rank total in bytes."""
        return max(r["total"] for r in self.per_rank)

    @property
    def max_total_mb(self) -> float:
        """The largest per-rank total in megabytes."""
        return self.max_total / _MB


def estimate_memory(
    layer_dims: Mapping[str, tuple[int, int]],
    grid: WorkerGrid,
    *,
    compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
    method: SecondOrderMethod | None = None,
    itemsize: int = 4,
    inv_itemsize: int | None = None,
    outer_product: bool = True,
    layer_groups: Mapping[str, int] | None = None,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
    diagonal_sides: Mapping[str, Diagonal] | None = None,
    owned_factors: bool = False,
    packed: bool = False,
    kl_clip: bool = True,
) -> MemoryEstimate:
    """Models every rank's K-FAC memory for one grid.

    Args:
        layer_dims: ``name -> (a_dim, g_dim)`` in model order.
        grid: The gradient-worker grid.
        compute_method: The method (or its name), when ``method`` is not given.
        method: The method object; its ``numel`` models the decompositions.
        itemsize: Bytes per element of the factors and gradients (4 for
            float32).
        inv_itemsize: Bytes per element of the decompositions (defaults to
            ``itemsize``).
        outer_product: Whether the eigen method stores the eigenvalue outer
            product.
        layer_groups: Kronecker blocks per layer (grouped convolutions);
            missing layers have one.
        assignment_strategy: Placement cost model (see
            :func:`~kaisa.distributed.placement.place_layers`).
        colocate_factors: Placement option.
        diagonal_sides: The sides each layer keeps as diagonals (``n`` elements, not
            ``n^2``); missing layers have none.
        owned_factors: Running factors only on the ranks that decompose them (FSDP2).
        packed: Running factors kept as upper triangles (``factor_storage='packed'``).
        kl_clip: Whether ``step()`` KL-clips (its grouped path keeps the KL products too).

    Returns:
        The estimate.
    """
    inv_size = itemsize if inv_itemsize is None else inv_itemsize
    if method is None:
        kind = parse_enum(ComputeMethod, compute_method, "compute_method")
        method = make_method(kind, outer_product=outer_product)
    groups = dict(layer_groups or {})
    diagonal = dict(diagonal_sides or {})
    placement = place_layers(layer_dims, grid, assignment_strategy, colocate_factors, diagonal)
    layer_numel = {name: groups.get(name, 1) * (
        _factor_numel(a, Side.A in diagonal.get(name, DENSE), packed)
        + _factor_numel(g, Side.G in diagonal.get(name, DENSE), packed))
        for name, (a, g) in layer_dims.items()}
    factor_numel = sum(layer_numel.values())
    per_rank: list[dict[str, int]] = []
    for rank in range(grid.world_size):
        mine = [lp.name for lp in placement.layers.values() if rank in (lp.a_rank, lp.g_rank)]
        held = factor_numel if not owned_factors else sum(layer_numel[n] for n in mine)
        decomp = 0
        steps: list[StepLayer] = []
        for lp in placement.layers.values():
            blocks = groups.get(lp.name, 1)
            if lp.is_grad_worker(rank):
                decomp += blocks * method.numel(lp.a_dim, lp.g_dim,
                                                diagonal=diagonal.get(lp.name, DENSE))
            path = _step_path(lp, rank, owned_factors, method.batched,
                              bool(diagonal.get(lp.name, DENSE)))
            steps.append(StepLayer(blocks * lp.a_dim * lp.g_dim, path))
        step = step_buffer_numel(steps, world=grid.world_size, kl_clip=kl_clip)
        entry = {
            "factors": held * itemsize,
            "decompositions": decomp * inv_size,
            # No batch factors: folded where computed and averaged in place, or (FSDP2)
            # folded where their averages arrive, by the end of the backward pass.
            "buffers": 0,
            "step_buffers": step * itemsize,
        }
        entry["total"] = (entry["factors"] + entry["decompositions"]
                          + max(entry["buffers"], entry["step_buffers"]))
        per_rank.append(entry)
    return MemoryEstimate(grid.fraction, placement, tuple(per_rank))


def _step_path(lp: LayerPlacement, rank: int, sharded: bool, batched: bool,
               diagonal: bool) -> StepPath:
    """How ``rank``'s ``step()`` preconditions layer ``lp`` (``kaisa.core.grouped.eligible``)."""
    if sharded:
        return "sharded"
    if not lp.is_grad_worker(rank) or lp.grad_receivers[rank]:
        return "broadcast"
    return "grouped" if batched and not diagonal else "local"


class FractionCost(Protocol):
    """Predicted seconds per iteration of the phases a placement decides.

    :class:`kaisa.plan.FractionObjective` is one (a cost model built from a compute
    profile and a network); ``grad_worker_fraction='auto'`` minimises it when
    :attr:`~kaisa.distributed.DistributedConfig.cost_model` is set.
    """

    def __call__(self, placement: Placement, *, layer_groups: Mapping[str, int],
                 diagonal_sides: Mapping[str, Diagonal]) -> float:
        """Seconds per iteration on ``placement``."""


def choose_fraction(
    layer_dims: Mapping[str, tuple[int, int]] | Sequence[tuple[str, int, int]],
    world_size: int,
    memory_budget_mb: float | None,
    *,
    estimate: Callable[[WorkerGrid], MemoryEstimate] | None = None,
    cost: Callable[[MemoryEstimate], float] | None = None,
    **model: object,
) -> MemoryEstimate:
    """Picks the fastest fraction that fits (with ``cost``), else the least communication.

    Without ``cost`` (the memory rule), fractions are tried from 1 (COMM-OPT)
    downwards. A larger fraction means more gradient workers per layer and fewer
    preconditioned-gradient broadcasts every step, which is KAISA's
    communication-optimal direction; decomposition broadcasts happen only on
    inverse-update steps. With ``cost`` (the time objective), every fraction that fits
    the budget (every one, without a budget) is priced and the cheapest is taken, the
    larger fraction on a tie.

    Args:
        layer_dims: ``name -> (a_dim, g_dim)`` in model order.
        world_size: Number of ranks.
        memory_budget_mb: Per-rank K-FAC memory budget in megabytes; ``None`` only with
            ``cost``.
        estimate: The memory model of one grid; by default :func:`estimate_memory`
            with the keyword arguments ``model``.
        cost: Predicted seconds per iteration of a fraction's estimate (its placement).
        **model: Keyword arguments of :func:`estimate_memory` (``compute_method``,
            ``itemsize``, ``layer_groups``, ...).

    Returns:
        The estimate of the chosen fraction.

    Raises:
        ValueError: If no valid fraction fits the budget; the message lists
            each fraction's modelled peak.
    """
    if memory_budget_mb is None and cost is None:
        raise ValueError("choose_fraction needs memory_budget_mb, a cost, or both")
    if memory_budget_mb is not None and memory_budget_mb <= 0:
        raise ValueError(f"memory_budget_mb must be > 0, got {memory_budget_mb}")
    dims: dict[str, tuple[int, int]]
    if isinstance(layer_dims, Mapping):
        dims = dict(layer_dims)
    else:
        dims = {name: (a, g) for name, a, g in layer_dims}
    tried: list[str] = []
    fits: list[tuple[float, int, MemoryEstimate]] = []
    for i, fraction in enumerate(valid_fractions(world_size)):
        grid = WorkerGrid(world_size, int(fraction * world_size))
        est = estimate(grid) if estimate is not None else estimate_memory(
            dims, grid, **model  # type: ignore[arg-type]
        )
        if memory_budget_mb is None or est.max_total_mb <= memory_budget_mb:
            if cost is None:
                return est
            fits.append((cost(est), i, est))
            continue
        tried.append(f"{fraction} ({grid.strategy_name}): {est.max_total_mb:.3f} MB")
    if fits:
        return min(fits, key=lambda item: (item[0], item[1]))[2]
    raise ValueError(
        f"no grad_worker_fraction fits memory_budget_mb={memory_budget_mb} on world size "
        f"{world_size}; modelled per-rank K-FAC memory: " + "; ".join(tried)
    )


def large_factor_message(f: FactorSize) -> str:
    """The warning for a factor above :data:`LARGE_FACTOR_DIM`: its size, cost and a way out."""
    blocks = f" x {f.blocks} groups" if f.blocks > 1 else ""
    return (
        f"kaisa: layer {f.layer!r} has a {f.dim}x{f.dim}{blocks} {f.side.value} factor: about "
        f"{f.nbytes / 2**20:.0f} MB (running and batch factor, decomposition) and "
        f"{f.gflop:.0f} GFLOP per decomposition (every inv_update_steps steps), likely most "
        f"of each step. Leave it out with skip_layers=[{('^' + re.escape(f.layer) + '$')!r}] "
        "or make the layer smaller"
    )
