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

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from kaisa.blocks import Conv2dBlock, CurvatureBlock
from kaisa.core.hooks import StatisticsRecorder
from kaisa.influence.rows import evaluating, example_dim

__all__ = ["Call", "Inputs", "Observer", "Pass", "examples_of", "positions_first"]

#: One observed call: its input, its output's gradient and its call site.
Call = tuple[torch.Tensor, torch.Tensor, int]
#: A batch's inputs: a tensor (``model(inputs)``) or keyword tensors (``model(**inputs)``,
#: an ``attention_mask`` among them masks the positions).
Inputs = torch.Tensor | Mapping[str, torch.Tensor]
T = TypeVar("T")


@dataclass
class Pass:
    """One pass of a batch: every block's calls, the examples, the attention mask."""

    calls: dict[str, list[Call]]
    examples: int
    mask: torch.Tensor | None  # (N, positions), 1 where a position counts


def examples_of(inputs: Inputs) -> int:
    """The batch's examples: dimension 0 of its (first) input tensor."""
    first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs.values()))
    return int(first.shape[0])


def positions_first(block: CurvatureBlock, t: torch.Tensor, mask: torch.Tensor
                    ) -> torch.Tensor | None:
    """``t`` as ``(N, positions, ...)`` when a call's rows are the mask's positions.

    ``None`` when they are not (a convolution's, or a call over other rows).
    """
    first = example_dim(block)
    n, length = mask.shape
    if t.dim() < 2 or t.shape[first] != n:
        return None
    t = t.movedim(first, 0)
    return t if t.shape[1] == length and (t.dim() == 2 or t.dim() == 3) else None


class Observer:
    """The core's hooks over ``blocks`` of ``model``, while :meth:`installed`."""

    def __init__(self, model: nn.Module, blocks: Mapping[str, CurvatureBlock], *,
                 progress: bool = False, masked: set[str] | None = None) -> None:
        self.model = model
        self.blocks = dict(blocks)
        #: The blocks an attention mask applies to (``None``: every block).
        self.masked = masked
        self._autocast: tuple[str, torch.dtype, bool] = ("cpu", torch.bfloat16, False)
        #: Show a progress bar per pass (``tqdm``, on standard error).
        self.progress = progress
        self._recorder: StatisticsRecorder | None = None
        self._calls: dict[str, list[Call]] = {}
        self._mask: torch.Tensor | None = None
        self._rows: dict[str, list[int]] = {}
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
        kind = next(self.model.parameters()).device.type
        amp = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        self._autocast = (kind, torch.get_autocast_dtype(kind) if amp else torch.float32, amp)
        try:  # the influence's own products at full precision; the model's as it was asked
            with torch.autocast(kind, enabled=False) if amp else contextlib.nullcontext():
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
            rows = examples_of(x)  # a convolution: its rows per example are fixed
            if x.dim() >= 2 and not isinstance(block, Conv2dBlock):
                rows = x.numel() // (x.shape[-1] if x.is_floating_point() else 1)
            mask = self._mask if self.applies(block.name) else None
            if mask is not None:  # the rows at masked positions are left out
                xs, ds = positions_first(block, x, mask), positions_first(block, d, mask)
                if xs is not None and ds is not None:
                    keep = mask.to(torch.bool)
                    x, d, rows = xs[keep], ds[keep], int(keep.sum())
            self._rows[block.name].append(rows)
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

    def run(self, inputs: Inputs, value: Callable[[Any], torch.Tensor]) -> Pass:
        """Every block's calls in one pass of ``inputs`` under ``value(outputs)``.

        In evaluation mode; each block's calls in the order their gradients arrived.
        """
        recorder = self._recorder
        assert recorder is not None, "run() inside installed()"
        mask = None if isinstance(inputs, torch.Tensor) else inputs.get("attention_mask")
        self._calls = {name: [] for name in self.blocks}
        self._rows = {name: [] for name in self.recording}
        self._mask = mask
        kind, dtype, amp = self._autocast
        try:
            with torch.enable_grad(), evaluating(self.model), torch.autocast(
                    kind, dtype=dtype, enabled=amp):
                outputs = (self.model(inputs) if isinstance(inputs, torch.Tensor)
                           else self.model(**inputs))
                loss = value(outputs)
            edges = list(recorder.kept_outputs)
            if edges:
                torch.autograd.grad(loss, edges, allow_unused=True)
            return Pass(self._calls, examples_of(inputs), mask)
        finally:
            recorder.end_step()
            self._calls, self._mask = {}, None

    def applies(self, name: str) -> bool:
        """Whether a batch's attention mask applies to block ``name``."""
        return self.masked is None or name in self.masked

    def batch_factors(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None, int]]:
        """``(A, G, rows)`` the :attr:`recording` blocks took in the last pass.

        The batch factors as the blocks' statistics give them (means over a call's rows),
        before :meth:`~kaisa.blocks.CurvatureBlock.combine` (a tied weight's uses
        stacked; combining is not linear, so it comes after the sums), and the rows of
        one call (their mean over the calls): what weighs the batch in the sums.
        """
        out = {}
        for name in self.recording:
            block, rows = self.blocks[name], self._rows.get(name) or [0]
            a, g = block.stats.take()
            out[name] = (a, g, round(sum(rows) / len(rows)))
            block.stats.clear()
        return out
