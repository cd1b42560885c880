"""The recommendation: a fraction and factor/inverse intervals within budget and target.

Among every valid fraction and every pair of intervals (``inv_update_steps`` a multiple
of ``factor_update_steps``), keep those whose modelled memory fits the budget and whose
overhead over the first-order step is at most the target; of those, take the most
frequent curvature (smallest ``inv_update_steps``, then ``factor_update_steps``) and, at
those intervals, the fastest fraction. When no pair meets the target, the fastest
configuration at the largest intervals is returned, flagged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from kaisa.plan.iteration import StepCost

__all__ = ["FACTOR_STEPS", "INV_STEPS", "Recommendation", "fastest", "recommend"]

#: ``factor_update_steps`` candidates.
FACTOR_STEPS = (1, 2, 5, 10, 20, 50)
#: ``inv_update_steps`` candidates.
INV_STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """What to run at one world size.

    Attributes:
        world_size: Ranks.
        fraction: The gradient-worker fraction.
        strategy: Its name (COMM-OPT, HYBRID-OPT, MEM-OPT or ``fraction=``).
        factor_update_steps: Steps between factor updates.
        inv_update_steps: Steps between decomposition updates.
        iteration_s: Predicted seconds per iteration.
        overhead: K-FAC's share over the first-order step.
        memory_mb: Modelled per-rank K-FAC memory.
        meets_target: Whether the overhead is within the target.
    """

    world_size: int
    fraction: Fraction
    strategy: str
    factor_update_steps: int
    inv_update_steps: int
    iteration_s: float
    overhead: float
    memory_mb: float
    meets_target: bool

    def describe(self) -> str:
        """One line for the report."""
        flag = "" if self.meets_target else "  (overhead target not met: best possible)"
        return (
            f"world {self.world_size}: grad_worker_fraction={self.fraction} ({self.strategy}),"
            f" factor_update_steps={self.factor_update_steps},"
            f" inv_update_steps={self.inv_update_steps}: {self.iteration_s * 1e3:.1f} ms/iter,"
            f" overhead {self.overhead:.1%}, {self.memory_mb:.0f} MB/rank{flag}"
        )


def fastest(costs: Sequence[StepCost], factor_update_steps: int, inv_update_steps: int,
            memory_budget_mb: float | None = None) -> StepCost | None:
    """The fastest grid at these intervals that fits the budget (ties: larger fraction)."""
    fits = [c for c in costs if memory_budget_mb is None or c.memory_mb <= memory_budget_mb]
    if not fits:
        return None
    return min(fits, key=lambda c: (c.total(factor_update_steps, inv_update_steps),
                                    -c.grid.fraction))


def recommend(costs: Sequence[StepCost], *, memory_budget_mb: float | None = None,
              overhead_target: float = 0.1, factor_steps: Sequence[int] = FACTOR_STEPS,
              inv_steps: Sequence[int] = INV_STEPS) -> Recommendation | None:
    """The recommendation for one world size (see the module docstring).

    Args:
        costs: :meth:`~kaisa.plan.IterationModel.sweep` of the world size.
        memory_budget_mb: Per-rank K-FAC memory budget, ``None`` for none.
        overhead_target: Largest acceptable overhead (0.1: 10% over the first-order step).
        factor_steps: ``factor_update_steps`` candidates.
        inv_steps: ``inv_update_steps`` candidates.

    Returns:
        The recommendation, or ``None`` when no fraction fits the budget.
    """
    pairs = sorted((i, f) for f in factor_steps for i in inv_steps if i % f == 0)
    if not pairs:
        raise ValueError("no interval pair: inv_update_steps must be a multiple of "
                         "factor_update_steps")
    chosen: tuple[StepCost, int, int] | None = None
    for inv, fac in pairs:
        best = fastest(costs, fac, inv, memory_budget_mb)
        if best is None:
            return None
        if best.overhead(fac, inv) <= overhead_target:
            chosen = (best, fac, inv)
            break
    met = chosen is not None
    if chosen is None:
        inv, fac = max(pairs, key=lambda p: (p[0], p[1]))
        best = fastest(costs, fac, inv, memory_budget_mb)
        assert best is not None
        chosen = (best, fac, inv)
    cost, fac, inv = chosen
    return Recommendation(
        world_size=cost.grid.world_size, fraction=cost.grid.fraction,
        strategy=cost.grid.strategy_name, factor_update_steps=fac, inv_update_steps=inv,
        iteration_s=cost.total(fac, inv), overhead=cost.overhead(fac, inv),
        memory_mb=cost.memory_mb, meets_target=met)
