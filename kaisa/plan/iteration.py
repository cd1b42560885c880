"""The per-phase cost of one K-FAC iteration on one gradient-worker grid.

Every phase is priced on the placement the engine computes
(:func:`kaisa.distributed.estimate_memory` calls
:func:`~kaisa.distributed.place_layers` exactly as
:class:`~kaisa.distributed.DistributedEngine` does) with the device's fitted kernels
(:class:`~kaisa.plan.compute.ComputeProfile`) and the alpha-beta collectives
(:mod:`kaisa.plan.collectives`):

* ``forward_backward``: the first-order step (measured, or the blocks' GEMM flops);
* ``grad_allreduce``: DDP's gradient allreduce left over after the backward pass;
* ``factor_compute``: the A and G covariances (in the hooks, every factor step);
* ``factor_comm``: what the factor allreduce adds after the backward pass. Its buckets
  start as each layer's backward pass ends and share the network with DDP's buckets in
  launch order (one queue), so most of it hides behind the backward pass;
* ``decomposition``: the slowest rank's eigendecompositions (one batched call per size);
* ``decomposition_comm``: the decompositions' broadcasts inside each worker group;
* ``precondition``: the slowest worker group's preconditioning, every step;
* ``gradient_comm``: the preconditioned gradients' broadcasts to receiver groups.

Factor phases happen every ``factor_update_steps`` steps and decomposition phases every
``inv_update_steps`` steps; :meth:`StepCost.iteration` amortises them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from kaisa.distributed import Placement, WorkerGrid, estimate_memory, valid_fractions
from kaisa.methods import DENSE, Diagonal, SecondOrderMethod, make_method
from kaisa.plan.collectives import Algorithm, Collective, bucketed_time
from kaisa.plan.compute import ComputeProfile
from kaisa.plan.network import NetworkSpec
from kaisa.plan.workload import Workload
from kaisa.utils.enums import AssignmentStrategy, ComputeMethod, Side, parse_enum

__all__ = ["PHASES", "FractionObjective", "IterationModel", "PlanConfig", "StepCost"]

_MB = 1024 * 1024
PHASES = ("forward_backward", "grad_allreduce", "factor_compute", "factor_comm",
          "decomposition", "decomposition_comm", "precondition", "gradient_comm")
_FACTOR_PHASES = ("factor_compute", "factor_comm")
_INVERSE_PHASES = ("decomposition", "decomposition_comm")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The K-FAC and communication settings a plan assumes (the preconditioner's names).

    Attributes:
        compute_method: Eigendecompositions or inverses.
        outer_product: Eigen: whether the eigenvalue outer product is stored.
        assignment_strategy: The placement's cost model.
        colocate_factors: Whether A and G of one block share a rank.
        symmetry_aware: Factors sent as upper triangles.
        bucket_cap_mb: K-FAC's fusion bucket capacity.
        ddp_bucket_cap_mb: DDP's gradient bucket capacity.
        factor_itemsize: Bytes per factor element.
        inv_itemsize: Bytes per decomposition element.
        grad_itemsize: Bytes per gradient element.
        algorithm: Collective algorithm (``AUTO``: NCCL's choice, the faster).
        backward_share: Share of the first-order step spent in the backward pass.
    """

    compute_method: ComputeMethod | str = ComputeMethod.EIGEN
    outer_product: bool = True
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    symmetry_aware: bool = False
    bucket_cap_mb: float = 25.0
    ddp_bucket_cap_mb: float = 25.0
    factor_itemsize: int = 4
    inv_itemsize: int = 4
    grad_itemsize: int = 4
    algorithm: Algorithm = Algorithm.AUTO
    backward_share: float = 2.0 / 3.0

    def method(self) -> SecondOrderMethod:
        """The second-order method object."""
        kind = parse_enum(ComputeMethod, self.compute_method, "compute_method")
        return make_method(kind, outer_product=self.outer_product)


@dataclass(frozen=True)
class StepCost:
    """Per-phase seconds of one grid, each phase priced when it runs.

    Attributes:
        grid: The gradient-worker grid.
        phases: Seconds of each phase on a step that runs it (see :data:`PHASES`).
        memory_mb: The modelled per-rank K-FAC memory peak (MB).
        placement: The engine's placement for this grid.
    """

    grid: WorkerGrid
    phases: Mapping[str, float]
    memory_mb: float
    placement: Placement = field(repr=False)

    def iteration(self, factor_update_steps: int = 1, inv_update_steps: int = 1
                  ) -> dict[str, float]:
        """Seconds per iteration by phase, the factor and decomposition phases amortised."""
        out = dict(self.phases)
        for name in _FACTOR_PHASES:
            out[name] /= factor_update_steps
        for name in _INVERSE_PHASES:
            out[name] /= inv_update_steps
        return out

    def total(self, factor_update_steps: int = 1, inv_update_steps: int = 1) -> float:
        """Seconds per iteration."""
        return sum(self.iteration(factor_update_steps, inv_update_steps).values())

    def overhead(self, factor_update_steps: int = 1, inv_update_steps: int = 1) -> float:
        """K-FAC's share on top of the first-order step (0.1 = 10% slower than SGD)."""
        first = self.phases["forward_backward"] + self.phases["grad_allreduce"]
        return self.total(factor_update_steps, inv_update_steps) / first - 1.0


def _payload_numel(method: SecondOrderMethod, n: int, diagonal: bool) -> int:
    """Elements one side's decomposition sends (its storage as the A side of an empty block)."""
    return method.numel(n, 0, diagonal=frozenset({Side.A}) if diagonal else DENSE)


def decomposition_seconds(placement: Placement, groups: Mapping[str, int],
                          diagonal: Mapping[str, Diagonal], compute: ComputeProfile,
                          method: SecondOrderMethod) -> float:
    """The slowest rank's decompositions: one batched call per size it owns."""
    per_rank: dict[int, Counter[int]] = {}
    for lp in placement.layers.values():
        for side, rank, n in ((Side.A, lp.a_rank, lp.a_dim), (Side.G, lp.g_rank, lp.g_dim)):
            if side not in diagonal.get(lp.name, DENSE):
                per_rank.setdefault(rank, Counter())[n] += groups.get(lp.name, 1)
    worst = 0.0
    for sizes in per_rank.values():
        t = sum(compute.eigh_s(n, count) * method.decompose_flops(n) / (9.0 * n**3)
                for n, count in sizes.items())
        worst = max(worst, t)
    return worst


def decomposition_comm_seconds(placement: Placement, groups: Mapping[str, int],
                               diagonal: Mapping[str, Diagonal], net: NetworkSpec,
                               method: SecondOrderMethod, config: PlanConfig) -> float:
    """The slowest worker group's decomposition broadcasts (one bucket stream per source)."""
    sent: dict[tuple[int, ...], Counter[int]] = {}
    for lp in placement.layers.values():
        diag = diagonal.get(lp.name, DENSE)
        for side, rank, n in ((Side.A, lp.a_rank, lp.a_dim), (Side.G, lp.g_rank, lp.g_dim)):
            numel = groups.get(lp.name, 1) * _payload_numel(method, n, side in diag)
            sent.setdefault(lp.grad_workers, Counter())[rank] += numel * config.inv_itemsize
    cap = config.bucket_cap_mb * _MB
    return max((sum(bucketed_time(Collective.BROADCAST, nbytes, group, net, cap,
                                  config.algorithm) for nbytes in by_src.values())
                for group, by_src in sent.items()), default=0.0)


def precondition_seconds(placement: Placement, groups: Mapping[str, int],
                         compute: ComputeProfile) -> float:
    """The slowest worker group's preconditioning (each of its ranks does all its blocks)."""
    load: dict[tuple[int, ...], float] = {}
    for lp in placement.layers.values():
        cost = groups.get(lp.name, 1) * compute.precondition_s(lp.a_dim, lp.g_dim)
        load[lp.grad_workers] = load.get(lp.grad_workers, 0.0) + cost
    return max(load.values(), default=0.0)


def gradient_comm_seconds(placement: Placement, groups: Mapping[str, int], net: NetworkSpec,
                          config: PlanConfig) -> float:
    """One receiver group's gradient broadcasts (all receiver groups run alike, at once)."""
    grid = placement.grid
    if grid.num_worker_groups == 1:
        return 0.0
    receivers = grid.receiver_groups()[0]
    sent: Counter[tuple[int, ...]] = Counter()
    for lp in placement.layers.values():
        sent[lp.grad_workers] += (groups.get(lp.name, 1) * lp.a_dim * lp.g_dim + 1) \
            * config.grad_itemsize
    cap = config.bucket_cap_mb * _MB
    return sum(bucketed_time(Collective.BROADCAST, nbytes, receivers, net, cap,
                             config.algorithm) for nbytes in sent.values())


class FractionObjective:
    """The fraction-dependent seconds per iteration, for ``grad_worker_fraction='auto'``.

    Decompositions and their broadcasts (amortised over ``inv_update_steps``),
    preconditioning and the gradient broadcasts: the phases the fraction changes (factor
    phases and the first-order step do not depend on it), so its minimum is the fraction
    a full :class:`IterationModel` finds fastest. Pass it as
    :attr:`kaisa.distributed.DistributedConfig.cost_model`.

    Args:
        compute: The device's kernel costs.
        network: The network.
        config: The K-FAC settings.
        inv_update_steps: Steps between decomposition updates.
    """

    def __init__(self, *, compute: ComputeProfile, network: NetworkSpec,
                 config: PlanConfig | None = None, inv_update_steps: int = 1) -> None:
        self.compute = compute
        self.network = network
        self.config = config or PlanConfig()
        self.inv_update_steps = inv_update_steps

    def __call__(self, placement: Placement, *, layer_groups: Mapping[str, int],
                 diagonal_sides: Mapping[str, Diagonal]) -> float:
        """Seconds per iteration of the fraction-dependent phases on ``placement``."""
        cfg, method = self.config, self.config.method()
        inverse = decomposition_seconds(placement, layer_groups, diagonal_sides, self.compute,
                                        method)
        inverse += decomposition_comm_seconds(placement, layer_groups, diagonal_sides,
                                              self.network, method, cfg)
        return (inverse / self.inv_update_steps
                + precondition_seconds(placement, layer_groups, self.compute)
                + gradient_comm_seconds(placement, layer_groups, self.network, cfg))


class IterationModel:
    """Predicts each phase of an iteration of ``workload`` for any grid.

    Args:
        workload: The model's blocks and rows.
        compute: The device's kernel costs.
        network: The network.
        config: The K-FAC settings.
    """

    def __init__(self, *, workload: Workload, compute: ComputeProfile, network: NetworkSpec,
                 config: PlanConfig | None = None) -> None:
        self.workload = workload
        self.compute = compute
        self.network = network
        self.config = config or PlanConfig()
        self._method = self.config.method()
        self._exposed: dict[tuple[int, bool], float] = {}  # (world, factors) -> seconds

    def first_order_seconds(self) -> float:
        """The first-order step: measured, or three times the blocks' forward GEMMs."""
        if self.compute.step_s is not None:
            return self.compute.step_s
        return 3.0 * self.compute.gemm_s(self.workload.forward_flops())

    def factor_compute_seconds(self) -> float:
        """Every block's A and G covariance on one rank (diagonal sides: ``rows n``)."""
        total = 0.0
        for b in self.workload.blocks:
            for side, n in ((Side.A, b.a_dim), (Side.G, b.g_dim)):
                if side in b.diagonal_sides:
                    total += self.compute.gemm_s(2.0 * b.rows * n)
                else:
                    total += b.groups * self.compute.covariance_s(b.rows, n)
        return total

    def factor_bytes(self) -> float:
        """Bytes of every block's A and G factors (packed when ``symmetry_aware``)."""
        cfg = self.config
        return float(sum(
            b.groups * (n if side in b.diagonal_sides else
                        n * (n + 1) // 2 if cfg.symmetry_aware else n * n)
            for b in self.workload.blocks
            for side, n in ((Side.A, b.a_dim), (Side.G, b.g_dim))) * cfg.factor_itemsize)

    def factor_allreduce_seconds(self, world_size: int) -> float:
        """The whole factor allreduce, not overlapped (buckets of ``bucket_cap_mb``)."""
        return bucketed_time(Collective.ALLREDUCE, self.factor_bytes(),
                             tuple(range(world_size)), self.network,
                             self.config.bucket_cap_mb * _MB, self.config.algorithm)

    def _exposed_comm(self, world: tuple[int, ...], with_factors: bool) -> float:
        """Seconds the network runs past the backward pass (DDP and factor buckets, FIFO)."""
        key = (len(world), with_factors)
        if key not in self._exposed:
            self._exposed[key] = self._simulate_buckets(world, with_factors)
        return self._exposed[key]

    def _simulate_buckets(self, world: tuple[int, ...], with_factors: bool) -> float:
        cfg, blocks = self.config, self.workload.blocks
        step = self.first_order_seconds()
        t_bwd = cfg.backward_share * step
        start = step - t_bwd
        flops = [2.0 * b.rows * b.grad_numel for b in blocks]
        total_flops = sum(flops) or 1.0
        covs = [0.0] * len(blocks)
        if with_factors:
            covs = [b.groups * self.compute.covariance_s(b.rows, b.g_dim) for b in blocks]
        # (launch time, is_factor, bytes): buckets in the order the backward pass fills them.
        events: list[tuple[float, int, float]] = []
        now = start
        ddp_cap, kfac_cap = cfg.ddp_bucket_cap_mb * _MB, cfg.bucket_cap_mb * _MB
        ddp_open = fac_open = 0.0
        block_params = 0
        for i in reversed(range(len(blocks))):
            b = blocks[i]
            now += t_bwd * flops[i] / total_flops + covs[i]
            block_params += b.grad_numel
            ddp_open += b.grad_numel * cfg.grad_itemsize
            if ddp_open >= ddp_cap:
                events.append((now, 0, ddp_open))
                ddp_open = 0.0
            if with_factors:
                numel = sum(n if side in b.diagonal_sides else
                            n * (n + 1) // 2 if cfg.symmetry_aware else n * n
                            for side, n in ((Side.A, b.a_dim), (Side.G, b.g_dim)))
                fac_open += float(b.groups * numel * cfg.factor_itemsize)
                if fac_open >= kfac_cap:
                    events.append((now, 1, fac_open))
                    fac_open = 0.0
        rest = max(0, self.workload.param_numel - block_params) * cfg.grad_itemsize
        events += [(now, 0, ddp_open + rest), (now, 1, fac_open)]
        busy = 0.0
        for launch, _, nbytes in sorted(events):
            busy = max(busy, launch) + bucketed_time(Collective.ALLREDUCE, nbytes, world,
                                                     self.network, 0.0, cfg.algorithm)
        return max(0.0, busy - now)

    def cost(self, grid: WorkerGrid) -> StepCost:
        """Every phase's seconds, and the memory peak, for ``grid``.

        Args:
            grid: The gradient-worker grid.

        Returns:
            The step cost.
        """
        w, cfg, method = self.workload, self.config, self._method
        groups, diagonal = w.layer_groups, w.diagonal_sides
        estimate = estimate_memory(
            w.layer_dims, grid, method=method, itemsize=cfg.factor_itemsize,
            inv_itemsize=cfg.inv_itemsize, layer_groups=groups,
            assignment_strategy=cfg.assignment_strategy, colocate_factors=cfg.colocate_factors,
            diagonal_sides=diagonal)
        placement = estimate.placement
        world = tuple(range(grid.world_size))
        ddp = self._exposed_comm(world, with_factors=False)
        phases = {
            "forward_backward": self.first_order_seconds(),
            "grad_allreduce": ddp,
            "factor_compute": self.factor_compute_seconds(),
            "factor_comm": max(0.0, self._exposed_comm(world, with_factors=True) - ddp),
            "decomposition": decomposition_seconds(placement, groups, diagonal, self.compute,
                                                   method),
            "decomposition_comm": decomposition_comm_seconds(placement, groups, diagonal,
                                                             self.network, method, cfg),
            "precondition": precondition_seconds(placement, groups, self.compute),
            "gradient_comm": gradient_comm_seconds(placement, groups, self.network, cfg),
        }
        return StepCost(grid, phases, estimate.max_total_mb, placement)

    def sweep(self, world_size: int) -> list[StepCost]:
        """:meth:`cost` of every valid fraction at ``world_size``, largest fraction first."""
        return [self.cost(WorkerGrid(world_size, int(f * world_size)))
                for f in valid_fractions(world_size)]
