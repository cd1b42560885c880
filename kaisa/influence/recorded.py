"""Covariances of the block kinds beyond the anchor's, from the curvature core's hooks.

Attention (observed at its functional calls), embeddings, a weight tied between an
embedding and a head, convolutions other than a plain ``nn.Conv2d``: their per-batch
factors are what the core's recorder (:class:`kaisa.core.hooks.StatisticsRecorder`) and
each block's kind compute in a training step (``docs/conventions.md``, "Influence", block
kinds), here of the summed loss with the Fisher's labels, in evaluation mode. Each
batch's factors (means over its rows) are summed weighted by the batch's examples.
Diagonal kinds and diagonal sides have no basis to fit (the identity's).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from kaisa.blocks import CurvatureBlock
from kaisa.core.hooks import StatisticsRecorder

__all__ = ["CoreStatistics"]


class CoreStatistics:
    """The core's recorder over ``blocks``, armed while :meth:`recording`."""

    def __init__(self, blocks: Mapping[str, CurvatureBlock]) -> None:
        self.blocks = dict(blocks)
        self._recorder: StatisticsRecorder | None = None

    def parameters(self) -> list[torch.Tensor]:
        """The blocks' parameters (what a backward pass must reach for their hooks to run)."""
        seen: dict[int, torch.Tensor] = {}
        for block in self.blocks.values():
            for p in block.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The recorder's hooks installed and recording (every module mode, divisor 1)."""
        if not self.blocks:
            yield
            return
        recorder = StatisticsRecorder(
            self.blocks, in_hook=True, grad_scaler=None, accumulation_steps=1,
            on_layer_done=lambda block: None, on_backward_end=lambda: None, timings={})
        recorder.any_mode, recorder.recording, recorder.divisor = True, True, 1.0
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

    def take(self) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Each block's batch factors ``(A, G)`` of the last forward and backward pass.

        Cleared, with the recorder's counts of the pass.
        """
        if self._recorder is not None:
            self._recorder.end_step()
        out = {}
        for name, block in self.blocks.items():
            out[name] = block.combine(*block.stats.take())
            block.stats.clear()
        return out
