"""Per-batch Kronecker factors of Linear and Conv1d/Conv2d layers (the conventions' math).

Every function returns a batch of factors shaped ``(groups, n, n)``: Linear layers and
ungrouped convolutions have one group. The heavy lifting goes through :mod:`kaisa.ops`
(the C++ extension when it is built, pure PyTorch otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import ops

__all__ = [
    "ConvGeometry",
    "conv_a_factor",
    "conv_g_factor",
    "linear_a_factor",
    "linear_g_factor",
]


@dataclass(frozen=True)
class ConvGeometry:
    """The parts of an ``nn.Conv2d`` that shape its patches.

    Attributes:
        kernel_size: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        dilation: ``(dh, dw)``.
        groups: number of groups.
        pad: explicit zero padding ``(left, right, top, bottom)`` (asymmetric for
            ``padding='same'`` with even effective kernels).
    """

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    pad: tuple[int, int, int, int]

    @classmethod
    def of(cls, module: nn.Conv1d | nn.Conv2d) -> ConvGeometry:
        """Read the geometry of ``module`` (``padding`` ints, tuples, 'same' or 'valid').

        A ``Conv1d`` is the ``Conv2d`` of height 1 (kernel ``(1, k)``, no vertical
        padding) on inputs with a unit height dimension.
        """
        if isinstance(module, nn.Conv1d):
            return cls._of(module.kernel_size, module.stride, module.dilation,
                           module.padding, module.groups, one_d=True)
        return cls._of(module.kernel_size, module.stride, module.dilation, module.padding,
                       module.groups, one_d=False)

    @classmethod
    def _of(cls, kernel: object, stride: object, dilation: object, padding: object,
            groups: int, *, one_d: bool) -> ConvGeometry:
        if one_d:  # height 1: the same numbers as (1, k) with no vertical padding
            kernel, stride, dilation = ((1, _one(v)) for v in (kernel, stride, dilation))
            if not isinstance(padding, str):
                padding = (0, _one(padding))
        kh, kw = _pair(kernel)
        dh, dw = _pair(dilation)
        if isinstance(padding, str):
            if padding == "valid":
                pad = (0, 0, 0, 0)
            else:  # 'same': torch puts the odd extra pixel on the right / bottom
                th, tw = dh * (kh - 1), dw * (kw - 1)
                pad = (tw // 2, tw - tw // 2, th // 2, th - th // 2)
        else:
            ph, pw = _pair(padding)
            pad = (pw, pw, ph, ph)
        return cls((kh, kw), _pair(stride), (dh, dw), int(groups), pad)


def _one(value: object) -> int:
    """The single entry of a ``Conv1d`` size (an int or a 1-tuple)."""
    if isinstance(value, (tuple, list)):
        assert len(value) == 1
        return int(value[0])
    assert isinstance(value, int)
    return value


def _pair(value: object) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    assert isinstance(value, (tuple, list)) and len(value) == 2
    return int(value[0]), int(value[1])


def linear_a_factor(x: torch.Tensor, *, bias: bool, dtype: torch.dtype) -> torch.Tensor:
    """``A_batch = Xb^T Xb / M`` of a Linear layer.

    Args:
        x: the layer input, any number of leading dimensions (may be non-contiguous).
        bias: whether the layer has a bias (appends a ones column).
        dtype: the factor dtype.

    Returns:
        ``(1, in+bias, in+bias)``.
    """
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    return ops.covariance(x2, 1.0 / max(x2.shape[0], 1), bias=bias).unsqueeze(0)


def linear_g_factor(
    grad_output: torch.Tensor, *, dtype: torch.dtype, loss_scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``G_batch = D^T D / M`` of a Linear layer, with ``D`` divided by the loss scale.

    A non-finite or non-positive loss scale gives a NaN factor, which the running
    average skips (and counts).

    Args:
        grad_output: gradient w.r.t. the layer output, any leading dimensions.
        dtype: the factor dtype.
        loss_scale: the grad scaler's scale (number or 0-d tensor).

    Returns:
        ``(1, out, out)``.
    """
    d = _unscale(grad_output.reshape(-1, grad_output.shape[-1]).to(dtype), loss_scale)
    return ops.covariance(d, 1.0 / max(d.shape[0], 1)).unsqueeze(0)


def linear_a_diagonal(x: torch.Tensor, *, bias: bool, dtype: torch.dtype) -> torch.Tensor:
    """``diag(Xb^T Xb / M)`` of a Linear layer, without the dense factor.

    Args:
        x: the layer input, any number of leading dimensions.
        bias: whether the layer has a bias (its coordinate is ``1``).
        dtype: the factor dtype.

    Returns:
        ``(1, in+bias)``.
    """
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    diagonal = x2.square().sum(0) / max(x2.shape[0], 1)
    if bias:
        diagonal = torch.cat([diagonal, diagonal.new_ones(1)])
    return diagonal.unsqueeze(0)


def linear_g_diagonal(
    grad_output: torch.Tensor, *, dtype: torch.dtype, loss_scale: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``diag(D^T D / M)`` of a Linear layer, with ``D`` divided by the loss scale.

    Args:
        grad_output: gradient w.r.t. the layer output, any leading dimensions.
        dtype: the factor dtype.
        loss_scale: the grad scaler's scale (as :func:`linear_g_factor`).

    Returns:
        ``(1, out)``.
    """
    d = _unscale(grad_output.reshape(-1, grad_output.shape[-1]).to(dtype), loss_scale)
    return (d.square().sum(0) / max(d.shape[0], 1)).unsqueeze(0)


def conv_a_factor(
    x: torch.Tensor, geometry: ConvGeometry, *, bias: bool, dtype: torch.dtype
) -> torch.Tensor:
    """``A_batch = (Pb/S)^T (Pb/S) / (N*S)`` per group of a Conv2d layer.

    Args:
        x: the layer input ``(N, C, H, W)`` (or ``(C, H, W)`` unbatched).
        geometry: the layer's :class:`ConvGeometry`.
        bias: whether the layer has a bias.
        dtype: the factor dtype.

    Returns:
        ``(groups, C/groups*kh*kw + bias, same)``.
    """
    if x.dim() == 3:
        x = x.unsqueeze(0)
    x = x.to(dtype)
    left, right, top, bottom = geometry.pad
    if left == right and top == bottom:
        padding = (top, left)
    else:
        x = F.pad(x, (left, right, top, bottom))
        padding = (0, 0)
    (kh, kw), (sh, sw), (dh, dw) = geometry.kernel_size, geometry.stride, geometry.dilation
    n, _, h, w = x.shape
    oh = (h + 2 * padding[0] - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * padding[1] - dw * (kw - 1) - 1) // sw + 1
    s = oh * ow
    scale = 1.0 / (max(n, 1) * float(s) ** 3)
    return ops.conv_covariance(
        x, geometry.kernel_size, geometry.stride, padding, geometry.dilation,
        geometry.groups, bias, scale,
    )


def conv_g_factor(
    grad_output: torch.Tensor,
    *,
    groups: int,
    dtype: torch.dtype,
    loss_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """``G_batch = (D/S)^T (D/S) / (N*S)`` per group of a Conv2d layer.

    Args:
        grad_output: ``(N, out, out_h, out_w)`` (or unbatched ``(out, out_h, out_w)``).
        groups: the layer's groups; group ``k`` uses output channels ``k*out/groups...``.
        dtype: the factor dtype.
        loss_scale: the grad scaler's scale.

    Returns:
        ``(groups, out/groups, out/groups)``.
    """
    if grad_output.dim() == 3:
        grad_output = grad_output.unsqueeze(0)
    n, _, oh, ow = grad_output.shape
    s = oh * ow
    d = _unscale(grad_output.to(dtype), loss_scale)
    scale = 1.0 / (max(n, 1) * float(s) ** 3)
    return ops.channel_covariance(d, groups, scale)


def _unscale(d: torch.Tensor, loss_scale: float | torch.Tensor) -> torch.Tensor:
    """``D / loss_scale`` before any product: no ratio of scales can overflow.

    A loss scale that is not a finite positive number (NaN, inf, 0, negative: a broken
    or misused scaler) turns ``D`` into NaNs, so the batch factor is skipped and counted
    instead of folding a wrong one in. A device scale is checked on the device (no host
    synchronisation).
    """
    if isinstance(loss_scale, torch.Tensor):
        s = loss_scale.to(d.dtype)
        valid = torch.isfinite(s) & (s > 0)
        return d / torch.where(valid, s, torch.full_like(s, math.nan))
    if loss_scale == 1.0:
        return d
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        return torch.full_like(d, math.nan)
    return d / loss_scale
