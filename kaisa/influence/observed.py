"""One forward and backward pass of the model, observed by the curvature core's hooks.

:class:`Observer` installs the core's recorder (:class:`kaisa.core.hooks.StatisticsRecorder`)
over the scored blocks, in every module mode and handing each observed call over paired
(its input and output gradient). :meth:`Observer.run` makes one pass of a batch under a
scalar of its outputs; the backward pass reaches only the blocks' outputs (no parameter's
gradient is computed, ``.grad`` is not touched) and returns, per block, its calls'
``(x, d, site)``. The factor pass also lets the kinds beyond the anchor's record their
batch factors as a training step would (:meth:`Observer.batch_factors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn

from kaisa.blocks import CurvatureBlock
from kaisa.core.hooks import StatisticsRecorder
from kaisa.influence.rows import evaluating

__all__ = ["Call", "Observer"]

#: One observed call: its input, its output's gradient and its call site.
Call = tuple[torch.Tensor, torch.Tensor, int]
T = TypeVar("T")


class Observer:
    """The core's hooks over ``blocks`` of ``model``, while :meth:`installed`."""

    def __init__(self, model: nn.Module, blocks: Mapping[str, CurvatureBlock], *,
                 progress: bool = False) -> None:
        self.model = model
        self.blocks = dict(blocks)
        #: Show a progress bar per pass (``tqdm``, on standard error).
        self.progress = progress
        self._recorder: StatisticsRecorder | None = None
        self._calls: dict[str, list[Call]] = {}
        #: Blocks that also record the core's batch factors (:meth:`batch_factors`).
        self.recording: set[str] = set()

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The recorder's hooks installed (every module mode, calls handed over paired)."""
        recorder = StatisticsRecorder(
            self.blocks, in_hook=True, grad_scaler=None, accumulation_steps=1,
            on_layer_done=lambda block: None, on_backward_end=lambda: None, timings={})
        recorder.any_mode, recorder.recording, recorder.keep_outputs = True, True, True
        recorder.pairs = self._pair
        for block in self.blocks.values():
            block.stats.clear()
        self._recorder = recorder
        try:
            yield
        finally:
            self._recorder = None
            recorder.remove()
            for block in self.blocks.values():
                block.stats.clear()

    def _pair(self, block: CurvatureBlock, x: torch.Tensor, d: torch.Tensor, site: int
              ) -> None:
        self._calls[block.name].append((x, d, site))
        if block.name in self.recording:  # the core's statistics, as in a training step
            block.record_input(x, in_hook=True, site=site)
            block.record_output_grad(d, 1.0, in_hook=True, inputs=x, site=site)

    def each(self, batches: Iterable[T], what: str) -> Iterable[T]:
        """``batches``, behind a progress bar named ``what`` when :attr:`progress` is set."""
        if not self.progress:
            return batches
        try:
            from tqdm import tqdm
        except ImportError as error:
            raise ImportError("progress=True needs tqdm: pip install tqdm") from error
        total = len(batches) if isinstance(batches, Sized) else None
        bar: Any = tqdm(batches, desc=f"influence: {what}", total=total, unit="batch",
                        leave=False)
        return bar  # type: ignore[no-any-return]

    def run(self, inputs: torch.Tensor, value: Callable[[torch.Tensor], torch.Tensor]
            ) -> dict[str, list[Call]]:
        """The calls of every block in one pass of ``inputs`` under ``value(outputs)``.

        In evaluation mode; each block's calls in the order their gradients arrived.
        """
        recorder = self._recorder
        assert recorder is not None, "run() inside installed()"
        self._calls = {name: [] for name in self.blocks}
        try:
            with torch.enable_grad(), evaluating(self.model):
                loss = value(self.model(inputs))
            edges = list(recorder.kept_outputs)
            if edges:
                torch.autograd.grad(loss, edges, allow_unused=True)
            return self._calls
        finally:
            recorder.end_step()
            self._calls = {}

    def batch_factors(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """The batch factors ``(A, G)`` the :attr:`recording` blocks took in the last pass.

        As the blocks' statistics give them, before :meth:`~kaisa.blocks.CurvatureBlock.combine`
        (a tied weight's uses stacked): combining is not linear, so it comes after the sums.
        """
        out = {}
        for name in self.recording:
            block = self.blocks[name]
            out[name] = block.stats.take()
            block.stats.clear()
        return out
