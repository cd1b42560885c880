"""Folding statistics into the running factors where they are computed.

A factor-update step does not keep a second, batch copy of every factor until ``step()``:
each micro-batch's statistics of a block are folded into its running factors as soon as
they are complete (``docs/conventions.md``, "Folding statistics where they are
computed"), and the distributed engine then averages the running factors over ranks.
:class:`FactorFolding` holds what a fold needs (the step's decay, whether a factor starts
from zero, the fold round) and how each block folds (:class:`Fold`): where computed, every
block whose running factors every rank holds and whose batch factors need no combining
across uses (a tied weight's do); on arrival, such a block whose running factors only some
ranks hold (FSDP2: its averaged batch factors are folded on those ranks as soon as they
arrive, :meth:`FactorFolding.fold_averages`); the others keep their batch factors until
``step()``.

The core (:class:`~kaisa.core.curvature.KFACCurvature`) arms it for each step and calls
:meth:`FactorFolding.fold` from the hooks (a block's micro-batch is complete) and at the end
of each micro-batch's backward pass (:meth:`FactorFolding.leftovers`: what a block recorded
without completing, e.g. an output that did not reach the loss).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping

from kaisa.blocks import CurvatureBlock
from kaisa.core.hooks import compute_saved
from kaisa.distributed.averaging import FactorPair
from kaisa.utils.enums import Side

__all__ = ["FactorFolding", "Fold"]


class Fold(enum.Enum):
    """Where a block's statistics are folded into its running factors."""

    #: Each micro-batch's, where they are computed (every rank holds the running factors).
    WHERE_COMPUTED = "where_computed"
    #: The step's, averaged to the ranks that hold the running factors, as they arrive
    #: there (a model FSDP2 shards).
    ON_ARRIVAL = "on_arrival"
    #: The step's, averaged over ranks, in ``step()`` (a tied weight's are combined first).
    IN_STEP = "in_step"


class FactorFolding:
    """The folding of one core's blocks.

    Args:
        accumulation_steps: Micro-batches per step (``k``: a micro-batch factor weighs
            ``(1 - rho) / k``).
    """

    def __init__(self, accumulation_steps: int) -> None:
        self._k = accumulation_steps
        #: The decay of the armed step, ``None`` while blocks do not fold.
        self.decay: float | None = None
        #: Running factors that do not exist yet start from zero (else the identity).
        self.zero_start = False
        #: The fold round: one per step (a factor is scaled by ``rho`` once a round).
        self.round = 0
        #: Whether a statistic was folded in this round.
        self.folded = False

    def arm(self, blocks: Iterable[CurvatureBlock], decay: float | None, *, zero_start: bool,
            foldable: Callable[[CurvatureBlock], Fold]) -> None:
        """Folds the coming step's statistics with ``decay`` (``None``: no folding)."""
        self.decay, self.zero_start = decay, zero_start
        self.apply(blocks, foldable)

    def apply(self, blocks: Iterable[CurvatureBlock],
              foldable: Callable[[CurvatureBlock], Fold]) -> None:
        """Marks how each of ``blocks`` folds (again after the blocks were rebuilt)."""
        for block in blocks:
            how = foldable(block) if self.decay is not None else Fold.IN_STEP
            block.stats.folding = how is Fold.WHERE_COMPUTED
            block.stats.fold_average = how is Fold.ON_ARRIVAL

    def fold_averages(self, blocks: Mapping[str, CurvatureBlock],
                      averages: Mapping[str, FactorPair]) -> None:
        """Folds the step's batch factors averaged over ranks, as they arrive.

        Each weighs ``1 - rho`` (they are the step's: every micro-batch, every rank); the
        same arithmetic as ``step()``'s fold, one :func:`kaisa.ops.fold_many` call per
        block (both sides).
        """
        decay = self.decay
        if not averages:
            return
        assert decay is not None, "averages to fold arrived while no step records"
        for name, (a_batch, g_batch) in averages.items():
            if a_batch is None and g_batch is None:
                continue
            blocks[name].factors.fold_micro(a_batch, g_batch, rho=decay, weight=1.0 - decay,
                                            round_=self.round, zero_start=self.zero_start)
            self.folded = True

    def fold(self, block: CurvatureBlock, *, whole_step: bool = False) -> None:
        """Folds what ``block`` recorded (one micro-batch's statistics) into its factors.

        Args:
            block: The block; nothing happens unless it folds.
            whole_step: The statistics are the whole step's (computed in ``step()``): they
                weigh ``1 - rho``, not ``(1 - rho) / k``.
        """
        stats, decay = block.stats, self.decay
        if not stats.folding or decay is None:
            return
        compute_saved(block)
        a_batch, g_batch = stats.take()
        weight = (1.0 - decay) if whole_step else (1.0 - decay) / self._k
        if a_batch is None and g_batch is None:
            return
        block.factors.fold_micro(a_batch, g_batch, rho=decay, weight=weight, round_=self.round,
                                 zero_start=self.zero_start)  # both sides in one call
        stats.folded.update(side for side, batch in ((Side.A, a_batch), (Side.G, g_batch))
                            if batch is not None)
        self.folded = True

    def leftovers(self, blocks: Iterable[CurvatureBlock], *, whole_step: bool = False) -> None:
        """:meth:`fold` of every folding block that holds statistics."""
        for block in blocks:
            stats = block.stats
            if stats.folding and (stats.has_factors or stats.saved_inputs or stats.saved_grads):
                self.fold(block, whole_step=whole_step)

    def end_round(self) -> None:
        """Ends the step's folds (the next step scales every factor by its decay again)."""
        self.round += 1
        self.folded = False
