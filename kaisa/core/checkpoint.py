"""What a product gives :mod:`kaisa.checkpoint` and takes back: one protocol for all three.

:class:`~kaisa.KFACPreconditioner`, :class:`~kaisa.EKFAC` and :class:`~kaisa.KFAC` each
implement :class:`KFACCheckpointable`; the checkpoint code calls these methods only, and
never asks which product it holds. A product declares its counters (JSON numbers, the
same on every rank), its random generator's state (if any) and whether that generator is
rank-local, and the optimizers it drives beside itself (:class:`~kaisa.KFAC`'s first-order
one); it takes all of it back, checked whole, in :meth:`KFACCheckpointable.load_kfac_state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kaisa.core.curvature import KFACCurvature
from kaisa.utils.ranks import rank, world_size

__all__ = ["KFACCheckpointable", "KFACState", "check_generator_state", "gathered_generators",
           "saved_generator"]


@dataclass(frozen=True, kw_only=True)
class KFACState:
    """A product's K-FAC state beside its per-block tensors.

    Attributes:
        counters: Step counters, schedules' numbers and the like: JSON values, the same
            on every rank.
        generator: The state of the product's random generator, ``None`` without one.
        generator_per_rank: Whether each rank's generator differs (seeded per rank), so a
            checkpoint keeps one per rank; else it is the same on every rank (one copy).
        layers: Per block, its entries (factors, decompositions); empty when the per-block
            state is saved separately (as :mod:`kaisa.checkpoint` does).
        optimizers: For a product that is itself the optimizer: its own torch state
            (``'self'``) and that of the optimizers it drives (by name), each as
            ``torch.optim.Optimizer.state_dict`` gives it; empty otherwise.
    """

    counters: dict[str, Any]
    generator: torch.Tensor | None = None
    generator_per_rank: bool = False
    layers: Mapping[str, Any] = field(default_factory=dict)
    optimizers: Mapping[str, dict[str, Any]] = field(default_factory=dict)


class KFACCheckpointable(Protocol):
    """What :mod:`kaisa.checkpoint` needs of a product (each of the three implements it)."""

    @property
    def curvature(self) -> KFACCurvature:
        """The curvature core (its blocks, engine and placement)."""
        ...

    def kfac_state_dict(self) -> KFACState:
        """The counters and the generator's state (no per-block tensors, no copies)."""
        ...

    def kfac_optimizers(self) -> dict[str, torch.optim.Optimizer | None]:
        """The optimizers the product drives beside itself, by name (``None``: absent here)."""
        ...

    def load_kfac_state_dict(self, state: KFACState) -> None:
        """Restores ``state`` (with its ``layers``), checked whole first.

        Raises:
            ValueError: If any part is malformed or does not fit; nothing is changed.
        """
        ...


def check_generator_state(state: object) -> None:
    """Raises ``ValueError`` unless ``state`` is a CPU ``torch.Generator``'s state."""
    try:
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"got {type(state).__name__}")
        torch.Generator().set_state(state)
    except (TypeError, RuntimeError, ValueError) as err:
        raise ValueError(f"state_dict generator is not a generator state ({err})") from None


def saved_generator(extra: dict[str, Any]) -> torch.Tensor | None:
    """This rank's row-generator state in a ``'kaisa'`` state (checked), or ``None``."""
    every = extra.get("generators")
    if every is not None:
        world = world_size()
        if not isinstance(every, list | tuple) or len(every) != world:
            raise ValueError(f"state_dict generators must be a list of {world} generator "
                             f"states (one per rank), got {type(every).__name__}"
                             + (f" of {len(every)}" if isinstance(every, list | tuple) else ""))
        for state in every:
            check_generator_state(state)
    generator = extra.get("generator")
    if generator is not None:
        check_generator_state(generator)
    if every is not None:
        mine = every[rank()]
        assert isinstance(mine, torch.Tensor)
        return mine
    return generator


def gathered_generators(state: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``state``, by rank (a collective when ``torch.distributed`` runs)."""
    world = world_size()
    if world == 1:
        return [state]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, state)
    return [t.clone() for t in out]
