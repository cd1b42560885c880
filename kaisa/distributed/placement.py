"""Longest-processing-time placement of K-FAC decompositions on ranks.

Layers are sorted by cost (``n^3`` per factor for ``assignment_strategy =
'compute'``, ``n^2`` for ``'memory'``, ``n`` for a diagonal factor under either; ``n`` is
the factor dimension) and each
is given, in that order, to the least-loaded gradient-worker group, and inside
it to the least-loaded rank. With ``colocate_factors=False`` the A and G
decompositions of one layer go to two different ranks of the group (when the
group has more than one rank).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kaisa.distributed.strategy import WorkerGrid
from kaisa.utils.enums import AssignmentStrategy, Side, parse_enum

__all__ = ["LayerPlacement", "Placement", "factor_cost", "place_layers"]


def factor_cost(
    dim: int, assignment_strategy: AssignmentStrategy | str, diagonal: bool = False
) -> float:
    """Cost of decomposing one ``dim x dim`` factor.

    Args:
        dim: Factor dimension ``n``.
        assignment_strategy: ``COMPUTE`` (``n^3``) or ``MEMORY`` (``n^2``), or the name.
        diagonal: The factor is kept as its diagonal: ``n`` under either strategy.

    Returns:
        The cost.
    """
    strategy = parse_enum(AssignmentStrategy, assignment_strategy, "assignment_strategy")
    if diagonal:
        return float(dim)
    return float(dim) ** (3 if strategy is AssignmentStrategy.COMPUTE else 2)


@dataclass(frozen=True)
class LayerPlacement:
    """Where one layer's K-FAC work happens.

    Attributes:
        name: Layer name.
        a_dim: Dimension of the A (activation) factor.
        g_dim: Dimension of the G (output-gradient) factor.
        worker_group: Index of the layer's gradient-worker group.
        grad_workers: Ranks that hold the decompositions and precondition the
            layer's gradient.
        a_rank: Rank that computes (and broadcasts) the A decomposition.
        g_rank: Rank that computes (and broadcasts) the G decomposition.
        grad_receivers: For each gradient worker, the ranks of its receiver
            group that are not gradient workers of this layer; the worker
            broadcasts the preconditioned gradient to them.
    """

    name: str
    a_dim: int
    g_dim: int
    worker_group: int
    grad_workers: tuple[int, ...]
    a_rank: int
    g_rank: int
    grad_receivers: Mapping[int, tuple[int, ...]]

    def is_grad_worker(self, rank: int) -> bool:
        """Whether ``rank`` keeps this layer's decompositions."""
        return rank in self.grad_workers

    def grad_source(self, rank: int) -> int:
        """The gradient worker that sends this layer's gradient to ``rank``.

        Returns ``rank`` itself for a gradient worker.
        """
        if rank in self.grad_workers:
            return rank
        for worker, receivers in self.grad_receivers.items():
            if rank in receivers:
                return worker
        raise ValueError(f"rank {rank} is not in the world of layer {self.name!r}")


@dataclass(frozen=True)
class Placement:
    """The result of :func:`place_layers` for a whole model.

    Attributes:
        grid: The gradient-worker grid.
        assignment_strategy: The cost model.
        colocate_factors: Whether A and G of one layer share a rank.
        layers: Per-layer placements, in the model's layer order.
        loads: Accumulated cost per rank.
    """

    grid: WorkerGrid
    assignment_strategy: AssignmentStrategy
    colocate_factors: bool
    layers: dict[str, LayerPlacement] = field(default_factory=dict)
    loads: tuple[float, ...] = ()

    def __getitem__(self, name: str) -> LayerPlacement:
        """Returns the placement of layer ``name``."""
        return self.layers[name]

    def computed_by(self, rank: int) -> list[tuple[str, Side]]:
        """The ``(layer, side)`` decompositions that ``rank`` computes."""
        out: list[tuple[str, Side]] = []
        for lp in self.layers.values():
            if lp.a_rank == rank:
                out.append((lp.name, Side.A))
            if lp.g_rank == rank:
                out.append((lp.name, Side.G))
        return out

    def held_by(self, rank: int) -> list[str]:
        """Layers whose decompositions ``rank`` keeps (it is a grad worker)."""
        return [lp.name for lp in self.layers.values() if lp.is_grad_worker(rank)]

    def describe(self) -> str:
        """A human-readable table of the placement, for logging."""
        grid = self.grid
        lines = [
            f"K-FAC placement: world_size={grid.world_size} strategy={grid.strategy_name} "
            f"grad_workers/layer={grid.grad_workers} assignment={self.assignment_strategy.value} "
            f"colocate_factors={self.colocate_factors}",
            f"  worker groups: {grid.worker_groups()}  receiver groups: {grid.receiver_groups()}",
        ]
        width = max([len(n) for n in self.layers] + [5])
        lines.append(
            f"  {'layer':<{width}}  {'A dim':>6} {'G dim':>6}  {'A@':>3} {'G@':>3}  "
            "grad workers -> receivers"
        )
        for lp in self.layers.values():
            sends = ", ".join(f"{w}->{list(r)}" for w, r in lp.grad_receivers.items() if r) or "-"
            lines.append(
                f"  {lp.name:<{width}}  {lp.a_dim:>6} {lp.g_dim:>6}  {lp.a_rank:>3} "
                f"{lp.g_rank:>3}  {list(lp.grad_workers)} -> {sends}"
            )
        loads = ", ".join(f"{r}:{load:.3g}" for r, load in enumerate(self.loads))
        lines.append(f"  load per rank ({self.assignment_strategy.value}): {loads}")
        return "\n".join(lines)


def place_layers(
    layer_dims: Mapping[str, tuple[int, int]] | Sequence[tuple[str, int, int]],
    grid: WorkerGrid,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
    diagonal_sides: Mapping[str, frozenset[Side]] | None = None,
) -> Placement:
    """Assigns every layer's decompositions with the LPT greedy heuristic.

    Args:
        layer_dims: ``name -> (a_dim, g_dim)`` (or ``(name, a_dim, g_dim)``
            triples) in model order.
        grid: The gradient-worker grid.
        assignment_strategy: ``COMPUTE`` (cost ``n^3``) or ``MEMORY`` (cost ``n^2``), or
            the name.
        colocate_factors: If ``False`` the A and G decompositions of a layer
            are computed by two different ranks of its worker group (when the
            group has at least two ranks).
        diagonal_sides: The sides each layer keeps as diagonals (cost ``n``); missing
            layers have none.

    Returns:
        The placement. It is a deterministic function of the arguments, so
        every rank computes the same one without communication.
    """
    items: list[tuple[str, int, int]]
    if isinstance(layer_dims, Mapping):
        items = [(name, int(a), int(g)) for name, (a, g) in layer_dims.items()]
    else:
        items = [(name, int(a), int(g)) for name, a, g in layer_dims]
    names = [n for n, _, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("layer names must be unique")
    assignment_strategy = parse_enum(
        AssignmentStrategy, assignment_strategy, "assignment_strategy"
    )

    diagonal = dict(diagonal_sides or {})
    costs = [
        (
            factor_cost(a, assignment_strategy, Side.A in diagonal.get(name, ())),
            factor_cost(g, assignment_strategy, Side.G in diagonal.get(name, ())),
        )
        for name, a, g in items
    ]
    groups = grid.worker_groups()
    receiver_groups = grid.receiver_groups()
    rank_load = [0.0] * grid.world_size
    group_load = [0.0] * len(groups)
    order = sorted(range(len(items)), key=lambda i: (-(costs[i][0] + costs[i][1]), i))
    placed: dict[str, LayerPlacement] = {}
    for i in order:
        name, a_dim, g_dim = items[i]
        a_cost, g_cost = costs[i]
        gi = min(range(len(groups)), key=lambda k: (group_load[k], k))
        group = groups[gi]
        group_load[gi] += a_cost + g_cost

        def least_loaded(exclude: int | None = None, members: tuple[int, ...] = group) -> int:
            cands = [r for r in members if r != exclude]
            return min(cands, key=lambda r: (rank_load[r], r))

        if colocate_factors or len(group) == 1:
            a_rank = g_rank = least_loaded()
            rank_load[a_rank] += a_cost + g_cost
        else:
            # Place the more expensive factor first, then the other on a
            # different rank of the same group.
            if a_cost >= g_cost:
                a_rank = least_loaded()
                rank_load[a_rank] += a_cost
                g_rank = least_loaded(exclude=a_rank)
                rank_load[g_rank] += g_cost
            else:
                g_rank = least_loaded()
                rank_load[g_rank] += g_cost
                a_rank = least_loaded(exclude=g_rank)
                rank_load[a_rank] += a_cost
        receivers = {
            w: tuple(r for r in receiver_groups[grid.receiver_group_of(w)] if r not in group)
            for w in group
        }
        placed[name] = LayerPlacement(
            name=name,
            a_dim=a_dim,
            g_dim=g_dim,
            worker_group=gi,
            grad_workers=group,
            a_rank=a_rank,
            g_rank=g_rank,
            grad_receivers=receivers,
        )
    ordered = {name: placed[name] for name in names}
    return Placement(
        grid=grid,
        assignment_strategy=assignment_strategy,
        colocate_factors=colocate_factors,
        layers=ordered,
        loads=tuple(rank_load),
    )
