"""Which blocks a decomposition step decomposes, and whether it warm-starts them.

``decomposition_spread = k`` splits the blocks into ``k`` parts of about equal cost and
decomposes each part on its own steps (``docs/conventions.md``, "Spread decompositions"),
so no single step decomposes every factor. ``basis_refresh='qr'`` warm-starts the eigen
method's bases between full decompositions (``docs/conventions.md``, "Warm-started
eigenbases"). The functions here are the rules, pure: :func:`spread_parts` makes the parts
from the blocks' costs, :func:`parts_due` says which parts a step decomposes and
:func:`warm_refresh` whether a decomposition step starts from the stored bases.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kaisa.blocks import CurvatureBlock
from kaisa.utils.enums import BasisRefresh, Side

__all__ = ["block_cost", "blocks_due", "parts_due", "spread_parts", "warm_refresh"]


def block_cost(block: CurvatureBlock) -> int:
    """A block's decomposition cost: ``n^3`` per dense side (times its groups), ``n`` diagonal.

    Args:
        block: The block.
    """
    return sum(block.groups * (n if block.is_diagonal(side) else n ** 3)
               for side, n in zip((Side.A, Side.G), block.dims, strict=True))


def spread_parts(costs: Sequence[tuple[str, int]], parts: int) -> list[list[str]]:
    """Blocks split into ``parts`` parts of about equal cost (largest first, greedily).

    Args:
        costs: ``(name, cost)`` per block, in model order.
        parts: The number of parts (at least 1).

    Returns:
        Per part, its blocks' names in model order (a part may be empty when there are
        fewer blocks than parts).
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i][1], i))
    totals = [0] * parts
    owner: dict[int, int] = {}
    for i in order:
        j = min(range(parts), key=lambda p: (totals[p], p))
        owner[i] = j
        totals[j] += costs[i][1]
    return [[costs[i][0] for i in range(len(costs)) if owner[i] == j] for j in range(parts)]


def parts_due(step: int, interval: int, parts: int) -> list[int]:
    """The parts step ``step`` decomposes (every part at step 0).

    Part ``j`` when ``step % interval == (j * interval) // parts``.

    Args:
        step: The step count.
        interval: ``inv_update_steps`` at this step.
        parts: The number of parts.
    """
    if step == 0:
        return list(range(parts))
    at = step % interval
    return [j for j in range(parts) if (j * interval) // parts == at]


def blocks_due(step: int, interval: int, parts: Sequence[Iterable[str]]) -> frozenset[str]:
    """The names of the blocks step ``step`` decomposes (:func:`parts_due` of ``parts``).

    Args:
        step: The step count.
        interval: ``inv_update_steps`` at this step.
        parts: The parts (:func:`spread_parts`).
    """
    return frozenset(name for j in parts_due(step, interval, len(parts)) for name in parts[j])


def warm_refresh(index: int, refresh: BasisRefresh, eigh_every: int, *, cuda: bool) -> bool:
    """Whether decomposition step number ``index`` (from 0) warm-starts the eigenbases.

    With ``'qr'`` (``'auto'`` on a CUDA device) every step but each ``eigh_every``-th
    (``index % eigh_every == 0``) is warm-started; with ``'eigh'`` (``'auto'`` elsewhere)
    none is.

    Args:
        index: The decomposition step's number: EKFAC's refresh count, the preconditioner's
            ``steps // inv_update_steps``.
        refresh: The configured refresh.
        eigh_every: Decomposition steps per full one.
        cuda: Whether the model is on a CUDA device.
    """
    warm = refresh is BasisRefresh.QR or (refresh is BasisRefresh.AUTO and cuda)
    return warm and index % eigh_every != 0
