"""Scale-and-shift blocks: ``nn.LayerNorm``, ``nn.RMSNorm`` and BatchNorm affine parameters.

Hugging Face's weight-only RMS norms (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``T5LayerNorm``,
...; :func:`~kaisa.blocks.declared.hf_rms_norm`) and classes declared like a norm
(:func:`~kaisa.blocks.declared.declare_module`) are blocks of this kind too.

A diagonal block: with ``xhat`` the normalised input
and ``D`` the output gradient, both as rows ``(M, E)`` (``M`` every position that shares
the parameters; for BatchNorm the channels are ``E``),
``F_scale = mean over rows of (xhat * D)^2`` and ``F_shift = mean over rows of D^2``,
running-averaged like a factor (starting from ones), and the preconditioned gradient is
``grad / (F + damping)`` (kfac-jax-like; its ``ScaleAndShiftDiagonal`` sums over an
example's positions before squaring and starts from zeros: this is the per-row second
moment, as KFAC-expand). The statistics are a ``(1, P, E)`` tensor (``P`` = 2 with a
shift, 1 without) kept in the G slot; there is no A factor and no decomposition, so these
blocks are preconditioned on every rank (:meth:`ScaleShiftBlock.precondition_diagonal`)
after their statistics are averaged over ranks like any factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.blocks.base import CurvatureBlock
from kaisa.blocks.declared import Like, declared, hf_rms_norm, norm_eps
from kaisa.utils.enums import Side

__all__ = ["ScaleShiftBlock"]

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: Class names of LayerNorms over dimension 1 of NCHW inputs (timm's).
CHANNELS_FIRST_NORMS = frozenset({"LayerNorm2d", "LayerNorm3d"})
#: torch's own norms, whose epsilon is ``eps``.
_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, *_BATCH_NORMS)


class ScaleShiftBlock(CurvatureBlock):
    """The diagonal curvature block of a normalisation layer's affine parameters."""

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = _TORCH_NORMS
    kind = "scale_shift"
    diagonal = True
    #: The statistics in the G slot are diagonal (start from ones, averaged unpacked).
    diagonal_sides = frozenset({Side.G})

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """The norms of torch, Hugging Face's RMS norms and classes declared like a norm."""
        if isinstance(module, cls.module_type) or hf_rms_norm(module):
            return True
        declaration = declared(module)
        return declaration is not None and declaration.like in (Like.RMS_NORM, Like.LAYER_NORM)

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """A declared norm needs its epsilon."""
        declaration = declared(module)
        if declaration is not None and norm_eps(module) is None:
            return (f"declared like {declaration.like.value!r}, but it has no number in "
                    f"attribute {declaration.eps!r} (its epsilon)")
        return None

    def setup(self) -> None:
        """Which normalisation the module computes, and its epsilon."""
        module = self.module
        declaration = declared(module)
        self._rms = isinstance(module, nn.RMSNorm) or hf_rms_norm(module) or (
            declaration is not None and declaration.like is Like.RMS_NORM)
        eps = getattr(module, "eps", None) if isinstance(module, _TORCH_NORMS) else norm_eps(module)
        self._eps: float | None = None if eps is None else float(eps)
        #: The norm's features are dimension 1 of its input (a LayerNorm that permutes
        #: NCHW inside its forward: HF's ``data_format="channels_first"``, timm's
        #: ``LayerNorm2d``), as for BatchNorm.
        self._channels_first = isinstance(module, _BATCH_NORMS) or (
            getattr(module, "data_format", None) == "channels_first"
            or type(module).__name__ in CHANNELS_FIRST_NORMS)

    @property
    def dims(self) -> tuple[int, int]:
        """``(P, E)``: scale (and shift) rows of ``E`` elements."""
        return 1 + int(self.has_bias), self.weight.numel()

    def factor_shape(self, side: Side) -> tuple[int, int, int]:
        """No A factor; the statistics ``(1, P, E)`` in the G slot."""
        return (1, 0, 0) if side is Side.A else (1, *self.dims)

    # ------------------------------------------------------------------ statistics
    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """``xhat`` as rows ``(M, E)`` in the factor dtype (training-mode statistics)."""
        module, x = self.module, x.to(self.dtype_for(x))
        rows = self._rows(x)
        if isinstance(module, _BATCH_NORMS):  # per channel, over the batch and positions
            mean, var = rows.mean(0), rows.var(0, unbiased=False)
            return (rows - mean) * torch.rsqrt(var + module.eps)
        eps = self._eps if self._eps is not None else torch.finfo(x.dtype).eps
        if self._rms:
            return rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
        return F.layer_norm(rows, rows.shape[-1:], eps=eps)  # one kernel: (rows - mean) / std

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (an input or output gradient) as rows ``(M, E)`` of the norm's features."""
        if self._channels_first:
            t = t.movedim(1, -1)
        return t.reshape(-1, self.weight.numel())

    def _grad_rows(self, d: torch.Tensor) -> torch.Tensor:
        return self._rows(d.to(self.dtype_for(d)))

    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        """Nothing: the output-gradient hook gets its call's input."""

    def record_output_grad(
        self, d: torch.Tensor, divisor: float | torch.Tensor, *, in_hook: bool,
        inputs: torch.Tensor | None, site: int = 0,
    ) -> None:
        """``[mean((xhat D)^2); mean(D^2)]`` of one call, with ``D / divisor``."""
        assert inputs is not None  # recorded in the hook, never saved for later
        xhat = self.normalized(inputs)
        rows = self._grad_rows(d)
        rows = rows / (divisor.to(rows.dtype) if isinstance(divisor, torch.Tensor) else divisor)
        parts = [(xhat * rows).square().mean(0)]
        if self.has_bias:
            parts.append(rows.square().mean(0))
        self.stats.add_g(torch.stack(parts).unsqueeze(0))

    def precondition_diagonal(self, grad: torch.Tensor, damping: float) -> torch.Tensor | None:
        """``grad / (F + damping)``, ``None`` before the first statistics."""
        f = self.factors.g
        if f is None:
            return None
        return (grad / (f.to(grad.dtype) + damping)).to(grad.dtype)

    # ------------------------------------------------------------------ gradients
    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """``[d scale; d shift]`` as ``(1, P, E)``; ``None`` without a scale gradient."""
        if grads is None:
            grads = [p.grad for p in self.parameters()]
        if grads[0] is None:
            return None
        rows = [grads[0].reshape(-1)]
        if self.has_bias:
            bias = grads[1]
            rows.append(torch.zeros_like(rows[0]) if bias is None else bias.reshape(-1))
        return torch.stack(rows).unsqueeze(0)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """One tensor per parameter (views)."""
        rows = matrix.reshape(-1, self.weight.numel())
        return [row.reshape(p.shape) for row, p in zip(rows, self.parameters(), strict=True)]
