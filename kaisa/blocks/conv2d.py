"""``nn.Conv2d`` and ``nn.Conv1d`` layers with zeros padding; groups are independent blocks.

A ``Conv1d`` is the ``Conv2d`` of height 1: its input ``(N, C, L)`` and output gradient
``(N, C', L')`` get a unit height dimension and the same factors follow.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks import factors
from kaisa.blocks.base import CurvatureBlock

__all__ = ["Conv1dBlock", "Conv2dBlock"]


class Conv2dBlock(CurvatureBlock):
    """An ``nn.Conv2d``: ``A = (Pb/S)^T (Pb/S) / (N S)``, ``G = (D/S)^T (D/S) / (N S)``."""

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Conv2d
    kind = "conv2d"

    def setup(self) -> None:
        """The convolution's geometry; its groups are independent blocks."""
        assert isinstance(self.module, (nn.Conv1d, nn.Conv2d))
        self.geometry = factors.ConvGeometry.of(self.module)
        self.groups = self.geometry.groups

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """Only zeros padding is supported."""
        mode = getattr(module, "padding_mode", "zeros")
        if mode != "zeros":
            return f"padding_mode={mode!r} is not supported (only 'zeros')"
        return None

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``(Pb/S)^T (Pb/S) / (N*S)`` per group."""
        return factors.conv_a_factor(
            x, self.geometry, bias=self.has_bias, dtype=self.dtype_for(x)
        )

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``(D/S)^T (D/S) / (N*S)`` per group."""
        return factors.conv_g_factor(
            grad_output, groups=self.groups, dtype=self.dtype_for(grad_output),
            loss_scale=loss_scale,
        )


class Conv1dBlock(Conv2dBlock):
    """An ``nn.Conv1d``: the ``Conv2d`` factors of its height-1 form."""

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Conv1d
    kind = "conv1d"

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """The ``Conv2d`` A factor of ``x`` as ``(N, C, 1, L)``."""
        return super().compute_a_batch(x.unsqueeze(-2))

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """The ``Conv2d`` G factor of the output gradient as ``(N, C', 1, L')``."""
        return super().compute_g_batch(grad_output.unsqueeze(-2), loss_scale)
