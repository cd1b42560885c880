"""KAISA distribution strategies and the gradient-worker grid.

KAISA (Pauloski et al., SC'21) parameterises the distribution of K-FAC work by
the *gradient-worker fraction* ``f``: for every layer, ``world_size * f`` ranks
(the layer's *gradient workers*) hold the layer's decompositions and
precondition its gradient; all other ranks receive the preconditioned gradient
by broadcast.

The ranks are laid out on a grid:

* gradient-worker groups are contiguous rank blocks of size ``world_size * f``
  (world 4, f = 0.5 -> ``{0, 1}``, ``{2, 3}``);
* receiver groups are the ranks with equal index inside their block
  (world 4, f = 0.5 -> ``{0, 2}``, ``{1, 3}``).

A layer is assigned to one gradient-worker group. Its inverse worker(s) inside
that group broadcast the decompositions within the group, and each gradient
worker broadcasts the preconditioned gradient to the non-workers of its
receiver group.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from fractions import Fraction

from kaisa.utils.enums import DistributedStrategy, parse_grad_worker_fraction

__all__ = [
    "DistributedStrategy",
    "FractionSpec",
    "WorkerGrid",
    "resolve_grad_workers",
    "strategy_fraction",
    "valid_fractions",
]


def strategy_fraction(strategy: DistributedStrategy, world_size: int) -> Fraction:
    """Returns the gradient-worker fraction a :class:`DistributedStrategy` denotes.

    ``COMM_OPT`` is 1, ``MEM_OPT`` is ``1 / world_size`` and ``HYBRID_OPT`` is
    1/2 (1 for a single process).

    Args:
        strategy: The named strategy.
        world_size: Number of ranks.

    Returns:
        The exact fraction of ranks that are gradient workers per layer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if strategy is DistributedStrategy.COMM_OPT:
        return Fraction(1)
    if strategy is DistributedStrategy.MEM_OPT:
        return Fraction(1, world_size)
    if world_size == 1:
        return Fraction(1)
    return Fraction(1, 2)


#: Accepted user-facing values for ``grad_worker_fraction``.
FractionSpec = DistributedStrategy | float | int | str


def valid_fractions(world_size: int) -> list[Fraction]:
    """Lists the gradient-worker fractions valid for a world size.

    A fraction ``f`` is valid when ``world_size * f`` is a whole number of
    gradient workers that divides ``world_size``.

    Args:
        world_size: Number of ranks.

    Returns:
        Valid fractions, largest first (fraction 1 = COMM-OPT first).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    divisors = [d for d in range(world_size, 0, -1) if world_size % d == 0]
    return [Fraction(d, world_size) for d in divisors]


def _format_fractions(world_size: int) -> str:
    return ", ".join(
        f"{float(f):g}" + (f" (={f})" if f.denominator != 1 else "")
        for f in valid_fractions(world_size)
    )


def resolve_grad_workers(fraction: FractionSpec, world_size: int) -> int:
    """Converts a gradient-worker fraction into a number of workers per layer.

    Args:
        fraction: A :class:`DistributedStrategy`, a float in ``(0, 1]`` or the
            name of a strategy (``"comm_opt"``, ``"mem_opt"``,
            ``"hybrid_opt"``). ``"auto"`` is resolved by the memory model
            (:func:`kaisa.distributed.memory.choose_fraction`), not here.
        world_size: Number of ranks.

    Returns:
        ``world_size * fraction``, the number of gradient workers per layer.

    Raises:
        ValueError: If the fraction is outside ``(0, 1]`` or ``world_size *
            fraction`` is not a whole divisor of ``world_size``. The message
            lists the valid fractions.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if isinstance(fraction, bool) or not isinstance(fraction, (numbers.Real, str,
                                                                DistributedStrategy)):
        raise TypeError(
            f"grad_worker_fraction must be a DistributedStrategy, float or 'auto', got "
            f"{type(fraction).__name__}"
        )
    try:
        parsed = parse_grad_worker_fraction(fraction)
    except ValueError as err:
        raise ValueError(
            f"{err}; valid fractions for world size {world_size}: {_format_fractions(world_size)}"
        ) from None
    if parsed == "auto":
        raise ValueError(
            "grad_worker_fraction='auto' must be resolved with a memory budget "
            "(see kaisa.distributed.memory.choose_fraction)"
        )
    if isinstance(parsed, DistributedStrategy):
        return int(strategy_fraction(parsed, world_size) * world_size)
    value = float(parsed)
    workers_float = value * world_size
    workers = round(workers_float)
    if workers < 1 or abs(workers - workers_float) > 1e-6 or world_size % workers != 0:
        raise ValueError(
            f"grad_worker_fraction={fraction!r} gives {workers_float:g} gradient workers per "
            f"layer, which must be a whole number dividing the world size {world_size}; valid "
            f"fractions for world size {world_size}: {_format_fractions(world_size)}"
        )
    return workers


@dataclass(frozen=True)
class WorkerGrid:
    """The KAISA grid of gradient-worker groups and receiver groups.

    Attributes:
        world_size: Number of ranks.
        grad_workers: Gradient workers per layer (size of a worker group).
    """

    world_size: int
    grad_workers: int

    def __post_init__(self) -> None:
        """Validates the grid shape."""
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.grad_workers < 1 or self.world_size % self.grad_workers != 0:
            raise ValueError(
                f"grad_workers={self.grad_workers} must divide world_size={self.world_size}"
            )

    @classmethod
    def from_fraction(cls, fraction: FractionSpec, world_size: int) -> WorkerGrid:
        """Builds the grid for a gradient-worker fraction.

        Args:
            fraction: See :func:`resolve_grad_workers`.
            world_size: Number of ranks.

        Returns:
            The grid.
        """
        return cls(world_size, resolve_grad_workers(fraction, world_size))

    @property
    def fraction(self) -> Fraction:
        """The exact gradient-worker fraction."""
        return Fraction(self.grad_workers, self.world_size)

    @property
    def num_worker_groups(self) -> int:
        """Number of gradient-worker groups (``world_size / grad_workers``)."""
        return self.world_size // self.grad_workers

    @property
    def strategy_name(self) -> str:
        """``COMM-OPT``, ``MEM-OPT``, ``HYBRID-OPT`` or ``fraction=<f>``."""
        if self.grad_workers == self.world_size:
            return "COMM-OPT"
        if self.grad_workers == 1:
            return "MEM-OPT"
        if 2 * self.grad_workers == self.world_size:
            return "HYBRID-OPT"
        return f"fraction={self.fraction}"

    def worker_groups(self) -> list[tuple[int, ...]]:
        """Gradient-worker groups: contiguous rank blocks of ``grad_workers``."""
        g = self.grad_workers
        return [tuple(range(b * g, (b + 1) * g)) for b in range(self.num_worker_groups)]

    def receiver_groups(self) -> list[tuple[int, ...]]:
        """Receiver groups: ranks with equal index inside their worker block."""
        g = self.grad_workers
        return [tuple(b * g + j for b in range(self.num_worker_groups)) for j in range(g)]

    def worker_group_of(self, rank: int) -> int:
        """Index of the gradient-worker group containing ``rank``."""
        self._check_rank(rank)
        return rank // self.grad_workers

    def receiver_group_of(self, rank: int) -> int:
        """Index of the receiver group containing ``rank``."""
        self._check_rank(rank)
        return rank % self.grad_workers

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
