"""Gram matrices ``scale * Xb^T Xb`` whose sum before the scale would overflow.

A finite input can give a non-finite Gram matrix: inputs of 1.2e19 make every entry of
``X^T X / M`` 1.44e38 (finite in float32), but ``X^T X`` before the ``1 / M`` is not, and
whether a kernel scales before or after its sum depends on the backend and the machine.
When ``rows * max|x|^2`` could reach the dtype's maximum, the input is multiplied by
``f = sqrt(scale)`` first and the result divided by ``f^2`` (by ``f`` in a bias row or
column) afterwards; otherwise ``f = 1``, which changes no bit. The choice is made on the
device (no host synchronisation) and is the same on every backend; on the CPU, where
reading it costs no wait, an input that needs no scaling is passed on as it is, with no
further call (not copied by ``x * 1``: a full pass over every factor's input, a third of
a conv layer's G factor time on ResNet-32), and one call (``aminmax``, whose two values
are read from memory) replaces the nine of the device's choice. The CUDA kernels apply
the same rule themselves (``csrc/cuda/covariance.cu``), so on a GPU the wrappers skip
this module.
"""

from __future__ import annotations

import math
from typing import cast

import torch

__all__ = ["prescaled", "rescaled"]


def prescaled(
    x: torch.Tensor, rows: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``(x * f, f)``: ``f = sqrt(scale)`` where the unscaled sum could overflow, else 1.

    On the CPU (eager) the choice is read on the host: one ``aminmax``, whose two values
    are read from memory, and ``f`` is a Python number (an input that needs no scaling is
    returned as it is, with ``f = 1.0``). Elsewhere (and in a compiled graph), and for an
    input that needs scaling, ``f`` is a 0-d tensor of ``x``'s dtype chosen on the device
    (no host synchronisation).

    Args:
        x: The input whose entries fill the Gram matrix (at most ``rows`` products of two
            entries are summed into each of its entries).
        rows: The number of products summed per entry.
        scale: The Gram matrix's multiplier (at most 1 where it matters: ``1 / rows``).

    Returns:
        The input to give the kernel, and ``f`` for :func:`rescaled`.
    """
    if x.numel() == 0 or rows == 0 or not 0.0 < scale < 1.0:
        return x, 1.0
    # rows * max|x|^2 > limit, as max|x| > sqrt(limit / rows): one reduction, one compare
    threshold = math.sqrt(torch.finfo(x.dtype).max / 4.0 / rows)  # margin for rounding
    plain = x.detach() if x.requires_grad and torch.is_grad_enabled() else x
    lo, hi = torch.aminmax(plain)  # min and max: far cheaper than a norm on the CPU
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        # no device to wait for: decide here, and pass a safe input on uncopied (a NaN
        # compares false, as on the device: it stays in the factor, which is skipped)
        # plain reads of CPU memory, no call (a 0-d tensor's tolist() is a number)
        top, bottom = cast(float, hi.tolist()), cast(float, lo.tolist())
        if not (top > threshold or -bottom > threshold):
            return x, 1.0
    risky = torch.maximum(hi, -lo) > threshold  # (the rare risky CPU input: as the device)
    f = 1.0 + risky.to(x.dtype) * (math.sqrt(scale) - 1.0)
    return x * f, f


def rescaled(gram: torch.Tensor, f: torch.Tensor | float, *, bias: bool) -> torch.Tensor:
    """Undoes :func:`prescaled` on ``gram`` (``(..., d, d)``, a bias row and column last).

    Divides by ``f^2``, and the bias row and column by ``f`` (their ones were not scaled);
    ``f = 1.0`` (a number) returns ``gram`` itself, and a tensor ``f = 1`` changes no bit.
    """
    if isinstance(f, float) and f == 1.0:
        return gram
    out = gram / (f * f)
    if bias:  # the ones were not scaled: the bias row and column by f, their corner by 1
        out[..., -1, :] *= f
        out[..., :, -1] *= f
    return out
