"""Ranks, checkpoints and sizes of the curvature core.

:class:`CurvatureState` is a part of :class:`~kaisa.core.curvature.KFACCurvature`: the
reductions over ranks the products need (:meth:`~CurvatureState.any_rank`, agreement of
settings), the per-block state dict (saved, checked, gathered over ranks and restored:
bit-exact resume) and the sizes the memory model and the products report.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch

from kaisa.blocks import CurvatureBlock, RunningFactors
from kaisa.blocks.collection import check_blocks_state, memory_usage, skipped_factor_updates
from kaisa.distributed import DistributedEngine, FactorSize, MemoryEstimate
from kaisa.distributed.agreement import check_same_on_ranks
from kaisa.distributed.gather import gather_decompositions, gather_factors
from kaisa.methods import SecondOrderMethod

__all__ = ["CurvatureState"]


class CurvatureState:
    """Ranks, checkpoints and sizes of :class:`~kaisa.core.curvature.KFACCurvature`."""

    _blocks: dict[str, CurvatureBlock]
    _engine: DistributedEngine
    _method: SecondOrderMethod
    _device: torch.device
    _inv_dtype: torch.dtype

    # ------------------------------------------------------------------ ranks
    def any_rank(self, flag: bool) -> bool:
        """Logical or of ``flag`` over ranks (every rank must call it)."""
        return self._engine.any_rank(flag)

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a few control scalars (on the blocks' device)."""
        return self._engine.mean_over_ranks(values)

    def check_same_on_ranks(self, settings: Mapping[str, object], *, what: str) -> None:
        """Raises the same ``ValueError`` on every rank unless ``settings`` agree on all.

        Every rank must call it at the same point (nothing is sent with one rank); see
        :func:`kaisa.distributed.agreement.check_same_on_ranks`.
        """
        check_same_on_ranks(settings, what=what, device=self._device)

    def is_grad_worker(self, name: str) -> bool:
        """Whether this rank keeps block ``name``'s decompositions."""
        return self._engine.is_grad_worker(name)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *, gather: bool = False) -> dict[str, dict[str, Any]]:
        """Per block: running factors, skip counts and decompositions.

        Args:
            gather: Also the decompositions this rank does not hold (MEM-OPT,
                HYBRID-OPT), from their gradient workers, and under FSDP2 the running
                factors, from their owners: a collective, every rank must call it
                (:mod:`kaisa.distributed.gather`). Without it such blocks are saved
                without them, and loading recomputes the decompositions.
        """
        state = {name: block.state_dict() for name, block in self._blocks.items()}
        if gather:
            for gathered in (
                gather_decompositions(self._engine, self._blocks, self._method, self._inv_dtype),
                gather_factors(self._engine, self._blocks),
            ):
                for name, entries in gathered.items():
                    state[name].update(entries)
        return state

    def check_state_dict(self, state: object) -> None:
        """Raises ``ValueError`` unless ``state`` holds a valid state of every block.

        It must name exactly this core's blocks, each checked by
        :meth:`~kaisa.blocks.CurvatureBlock.check_state_dict` (shapes, finiteness).
        """
        check_blocks_state(self._blocks, state)

    def load_state_dict(
        self, state: Mapping[str, Any], *, damping: float, compute_inverses: bool = True
    ) -> None:
        """Restores :meth:`state_dict` output (checked first: all or nothing).

        Args:
            state: The saved per-block state.
            damping: The damping for blocks saved without decompositions.
            compute_inverses: Recompute decompositions from the factors where they were
                not saved (saved ones are restored as they were: bit-exact resume).

        Raises:
            ValueError: If the state is malformed (see :meth:`check_state_dict`).
        """
        self.check_state_dict(state)
        for name, block in self._blocks.items():
            block.load_state_dict(state[name])
            if not self.is_grad_worker(name):
                block.decomposition.clear()
            if not self._engine.holds_factors(name):  # FSDP2: on their owners only
                block.factors = RunningFactors(diagonal_sides=block.diagonal_sides)
        need = any(
            (b.factors.a is not None or not self._engine.holds_factors(name))
            and not b.has_decomposition() and self.is_grad_worker(name)
            for name, b in self._blocks.items()
        )
        need = self.any_rank(need)  # every rank takes part in the broadcasts
        if compute_inverses and need:
            self._engine.update_decompositions(damping)

    # ------------------------------------------------------------------ sizes
    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank memory for every valid ``grad_worker_fraction``."""
        return self._engine.memory_estimates()

    def factor_sizes(self) -> list[FactorSize]:
        """Every factor's dimension, memory and decomposition cost, largest first."""
        return self._engine.factor_sizes()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank by kind, plus ``'total'``."""
        return memory_usage(self._blocks)

    @property
    def skipped_factor_updates(self) -> int:
        """Per-batch factors not folded in because they were non-finite (syncs once)."""
        return skipped_factor_updates(self._blocks)
