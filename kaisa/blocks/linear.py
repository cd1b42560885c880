"""``nn.Linear`` layers (any number of leading input dimensions)."""

from __future__ import annotations

import torch
from torch import nn

from kaisa import factors
from kaisa.blocks.base import CurvatureBlock

__all__ = ["LinearBlock"]


class LinearBlock(CurvatureBlock):
    """An ``nn.Linear``: ``A = Xb^T Xb / M``, ``G = D^T D / M``."""

    module_type = nn.Linear
    kind = "linear"

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``Xb^T Xb / M``."""
        return factors.linear_a_factor(x, bias=self.has_bias, dtype=self.dtype_for(x))

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``D^T D / M``."""
        return factors.linear_g_factor(
            grad_output, dtype=self.dtype_for(grad_output), loss_scale=loss_scale
        )
