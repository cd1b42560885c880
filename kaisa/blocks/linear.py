"""``nn.Linear`` layers (any number of leading input dimensions)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks import factors
from kaisa.blocks.base import CurvatureBlock
from kaisa.utils.enums import KFACApprox

__all__ = ["LinearBlock"]


class LinearBlock(CurvatureBlock):
    """An ``nn.Linear``: ``A = Xb^T Xb / M``, ``G = D^T D / M``.

    The first input dimension is the batch (``N``), every other leading dimension is
    shared by the weight. ``kfac_approx='expand'`` makes every position a row
    (``M = N R``); ``'reduce'`` makes one row per example from the inputs' mean and the
    output gradients' sum over the shared dimensions (``M = N``; equal to expand when
    there is no shared dimension).
    """

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Linear
    kind = "linear"

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``Xb^T Xb / M`` (rows: positions, or examples' mean inputs)."""
        dtype = self.dtype_for(x)
        if self._reduces(x):
            x = x.to(dtype).mean(dim=self._shared_dims(x))
        return factors.linear_a_factor(x, bias=self.has_bias, dtype=dtype)

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``D^T D / M`` (rows: positions, or examples' summed output gradients)."""
        dtype = self.dtype_for(grad_output)
        if self._reduces(grad_output):
            grad_output = grad_output.to(dtype).sum(dim=self._shared_dims(grad_output))
        return factors.linear_g_factor(grad_output, dtype=dtype, loss_scale=loss_scale)

    def _reduces(self, t: torch.Tensor) -> bool:
        return self.kfac_approx is KFACApprox.REDUCE and t.dim() > 2

    def _shared_dims(self, t: torch.Tensor) -> tuple[int, ...]:
        """The dimensions ``'reduce'`` averages (sums) over: all but the batch's (first)."""
        return tuple(range(1, t.dim() - 1))
