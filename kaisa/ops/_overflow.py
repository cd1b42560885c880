"""Gram matrices ``scale * Xb^T Xb`` whose sum before the scale would overflow.

A finite input can give a non-finite Gram matrix: inputs of 1.2e19 make every entry of
``X^T X / M`` 1.44e38 (finite in float32), but ``X^T X`` before the ``1 / M`` is not, and
whether a kernel scales before or after its sum depends on the backend and the machine.
When ``rows * max|x|^2`` could reach the dtype's maximum, the input is multiplied by
``f = sqrt(scale)`` first and the result divided by ``f^2`` (by ``f`` in a bias row or
column) afterwards; otherwise ``f = 1``, which changes no bit. The choice is made on the
device (no host synchronisation) and is the same on every backend; on the CPU, where
reading it costs no wait, an input that needs no scaling is passed on as it is (not
copied by ``x * 1``: a full pass over every factor's input, a third of a conv layer's G
factor time on ResNet-32).
"""

from __future__ import annotations

import math

import torch

__all__ = ["prescaled", "rescaled"]


def prescaled(x: torch.Tensor, rows: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * f, f)``: ``f = sqrt(scale)`` where the unscaled sum could overflow, else 1.

    Args:
        x: The input whose entries fill the Gram matrix (at most ``rows`` products of two
            entries are summed into each of its entries).
        rows: The number of products summed per entry.
        scale: The Gram matrix's multiplier (at most 1 where it matters: ``1 / rows``).

    Returns:
        The input to give the kernel, and ``f`` (a 0-d tensor of ``x``'s dtype) for
        :func:`rescaled`.
    """
    if x.numel() == 0 or rows == 0 or not 0.0 < scale < 1.0:
        return x, torch.ones((), dtype=x.dtype, device=x.device)
    # rows * max|x|^2 > limit, as max|x| > sqrt(limit / rows): one reduction, one compare
    threshold = math.sqrt(torch.finfo(x.dtype).max / 4.0 / rows)  # margin for rounding
    lo, hi = torch.aminmax(x.detach())  # min/max: far cheaper than a norm on CPU
    risky = torch.maximum(hi, -lo) > threshold
    # on the CPU there is no device to wait for: skip x * 1 (not in a compiled graph)
    if x.device.type == "cpu" and not torch.compiler.is_compiling() and not bool(risky):
        return x, torch.ones((), dtype=x.dtype, device=x.device)
    f = 1.0 + risky.to(x.dtype) * (math.sqrt(scale) - 1.0)
    return x * f, f


def rescaled(gram: torch.Tensor, f: torch.Tensor, *, bias: bool) -> torch.Tensor:
    """Undoes :func:`prescaled` on ``gram`` (``(..., d, d)``, a bias row and column last).

    Divides by ``f^2``, and the bias row and column by ``f`` (their ones were not scaled);
    with ``f = 1`` every bit stays.
    """
    out = gram / (f * f)
    if bias:  # the ones were not scaled: the bias row and column by f, their corner by 1
        out[..., -1, :] *= f
        out[..., :, -1] *= f
    return out
