"""How the curvature core records statistics: arming the hooks and scoping G's passes.

:class:`RecordingControl` is a part of :class:`~kaisa.core.curvature.KFACCurvature`:
whether the coming forward passes record (:attr:`~RecordingControl.recording`), how the
recorded micro-batches are folded (:meth:`~RecordingControl.arm`, with
:mod:`kaisa.core.folding`), and which backward passes record output gradients
(:meth:`~RecordingControl.output_gradients`). The hooks themselves are
:mod:`kaisa.core.hooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.core.folding import FactorFolding, Fold
from kaisa.core.hooks import StatisticsRecorder
from kaisa.distributed import DistributedEngine

__all__ = ["ArmPlan", "RecordingControl"]

#: What a step records, evaluated when the step first needs it: whether its forward passes
#: record, and the decay they fold with (``None`` where they do not record).
ArmPlan = tuple[bool, float | None]


class RecordingControl:
    """The recording switches of :class:`~kaisa.core.curvature.KFACCurvature`."""

    _blocks: dict[str, CurvatureBlock]
    _engine: DistributedEngine
    _recorder: StatisticsRecorder
    _folding: FactorFolding

    # ------------------------------------------------------------------ recording
    @property
    def recording(self) -> bool:
        """Whether forward passes record statistics (the product arms it per step).

        Reading it reads the coming step's plan (:meth:`arm_when_used`): asked, it is due.
        """
        self._recorder.resolve()
        return self._recorder.recording

    @recording.setter
    def recording(self, value: bool) -> None:
        self._recorder.pending = None
        self._recorder.recording = bool(value)

    def arm_when_used(self, plan: Callable[[], ArmPlan], *, fold: bool = True,
                      zero_start: bool = False) -> None:
        """Arms the coming step with ``plan``, called when the step first needs it.

        That is the step's first observed forward pass, or :meth:`resolve_arm` (a
        product's ``step()`` calls it first): a step's hyperparameters (callables of the
        step) are evaluated at the step that uses them, never after the last one.

        Args:
            plan: ``(recording, decay)`` of the step.
            fold: Arm the folds (:meth:`arm`); ``False``: set :attr:`recording` alone
                (statistics kept for ``step()``).
            zero_start: See :meth:`arm`.
        """
        def apply() -> None:
            recording, decay = plan()
            if fold:
                self.arm(recording, decay=decay, zero_start=zero_start)
            else:
                self.recording = recording

        self._recorder.recording = False
        self._recorder.pending = apply

    def resolve_arm(self) -> None:
        """Evaluates the pending :meth:`arm_when_used` plan, if any."""
        self._recorder.resolve()

    def arm(self, recording: bool, *, decay: float | None, zero_start: bool = False) -> None:
        """Whether the coming forward passes record statistics, and how they are folded.

        The recorded micro-batches are folded into the running factors where they are
        computed, with the step's decay ``rho`` (``docs/conventions.md``, "Folding
        statistics where they are computed"), and the running factors are averaged over
        ranks by the end of the backward pass. Blocks whose running factors some ranks do
        not hold (FSDP2) have their averaged batch factors folded on the ranks that hold
        them as they arrive; those whose uses are combined (a tied weight) keep batch
        factors until :meth:`update_factors`.

        Args:
            recording: Whether to record (a factor-update step).
            decay: The running-average decay of the step (read when it records).
            zero_start: Running factors that do not exist yet start from zero, not the
                identity.
        """
        if recording and decay is None:
            raise ValueError("a recording step needs its factor decay")
        self.recording = recording
        self._folding.arm(self._blocks.values(), decay if recording else None,
                          zero_start=zero_start, foldable=self._foldable)

    def _foldable(self, block: CurvatureBlock) -> Fold:
        """Where ``block`` folds its statistics (:class:`~kaisa.core.folding.Fold`)."""
        if type(block).combine is not CurvatureBlock.combine:
            return Fold.IN_STEP
        if len(self._engine.factor_holders(block.name)) == self._engine.world_size:
            return Fold.WHERE_COMPUTED
        return Fold.ON_ARRIVAL

    @property
    def recorder(self) -> StatisticsRecorder:
        """The hooks that record the statistics (``keep_outputs``, ``kept_outputs``)."""
        return self._recorder

    @contextmanager
    def output_gradients(
        self, *, passes: int, divisor: float | torch.Tensor | None = None
    ) -> Iterator[None]:
        """Scopes which backward passes record G factors.

        Outside any scope every backward pass of a recorded forward records G, divided by
        the configured grad scaler's loss scale.

        Args:
            passes: Backward passes per recorded forward in the block (one per
                Monte-Carlo sample); 0 records none.
            divisor: What output gradients are divided by in the block (e.g. a Fisher
                scale times the loss scale); ``None`` keeps the grad scaler's scale.
        """
        recorder = self._recorder
        previous = (recorder.g_passes, recorder.divisor)
        recorder.g_passes, recorder.divisor = passes, divisor
        try:
            yield
        finally:
            recorder.g_passes, recorder.divisor = previous
