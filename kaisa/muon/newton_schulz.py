"""Muon's arithmetic as pure functions, batched over matrices of one shape.

:func:`orthogonalize` is ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` on a stack
``(k, m, n)``: the same operations per matrix (``bmm``/``baddbmm`` where Muon calls
``mm``/``addmm``), so a stack gives each matrix the bits Muon gives it alone
(``docs/conventions.md``, "KFACMuon"). :func:`momentum_update` is Muon's buffer update and
Nesterov mix, :func:`adjusted_lr` its learning-rate adjustment.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DEFAULT_EPS", "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "adjusted_lr",
    "check_adjust_lr_fn", "momentum_update", "orthogonalize",
]

#: ``torch.optim.Muon``'s defaults (Keller Jordan's quintic coefficients).
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

_ADJUST = (None, "original", "match_rms_adamw")


def orthogonalize(
    u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``steps`` Newton-Schulz iterations on each matrix of ``u`` ``(k, m, n)``, in ``dtype``.

    Each matrix with more rows than columns is transposed first (and back after);
    ``X <- X / max(||X||_F, eps)``, then ``S = X X^T``, ``X <- a X + (b S + c S S) X``.

    A stack of several matrices is computed with ``bmm``/``baddbmm``, the same operations
    as Muon's ``mm``/``addmm`` per matrix, whose float32 accumulation inside a bfloat16
    product may be ordered differently (measured on the CPU: one of 300 stacks of two
    ``16 x 16`` matrices differed in some element, none at ``64 x 64`` and above); a stack
    of one matrix takes Muon's own calls.

    Returns:
        The stack in ``dtype`` (as Muon returns it).
    """
    a, b, c = coefficients
    if u.shape[0] == 1:  # one matrix: Muon's own 2-D calls (bmm may round differently)
        return _orthogonalize_one(u[0], coefficients, steps, eps, dtype).unsqueeze(0)
    x = u.to(dtype)
    tall = u.size(-2) > u.size(-1)
    if tall:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / norm.clamp_(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def _orthogonalize_one(
    u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` on one matrix, call for call."""
    a, b, c = coefficients
    x = u.to(dtype)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def momentum_update(
    buffer: torch.Tensor, direction: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """Muon's ``buf.lerp_(d, 1 - mu)``, then ``d.lerp(buf, mu)`` (Nesterov) or ``buf``."""
    buffer.lerp_(direction, 1 - momentum)
    return direction.lerp(buffer, momentum) if nesterov else buffer


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's learning rate for an ``rows x cols`` matrix.

    ``lr sqrt(max(1, rows / cols))`` for ``None``/``'original'``,
    ``0.2 lr sqrt(max(rows, cols))`` for ``'match_rms_adamw'``.
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    else:
        ratio = 0.2 * math.sqrt(max(rows, cols))
    return lr * ratio


def check_adjust_lr_fn(value: object) -> None:
    """Raises ``ValueError`` unless ``value`` is one of Muon's adjustments."""
    if value not in _ADJUST:
        raise ValueError(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got "
                         f"{value!r}")
