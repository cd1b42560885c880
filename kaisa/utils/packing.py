"""Symmetric packing: the upper triangle of ``(..., n, n)`` matrices only.

``n(n+1)/2`` of ``n^2`` elements, mirrored back when unpacked. Used by the communicators
when ``symmetry_aware=True`` (only the triangles travel) and by running factors kept
packed (``factor_storage='packed'``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["pack_symmetric", "packed_numel", "unpack_symmetric"]

_TRIU_CACHE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _triu(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the upper triangle of an ``n x n`` matrix, and its mask."""
    key = (n, device)
    idx = _TRIU_CACHE.get(key)
    if idx is None:
        iu = torch.triu_indices(n, n, device=device)
        flat = iu[0] * n + iu[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).triu_()
        idx = (flat, mask)
        _TRIU_CACHE[key] = idx
    return idx


def _check_square(shape: Sequence[int]) -> int:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"symmetric packing needs (..., n, n) tensors, got shape {tuple(shape)}")
    return int(shape[-1])


def packed_numel(shape: Sequence[int], symmetric: bool) -> int:
    """Number of elements sent for a tensor of ``shape``.

    Args:
        shape: Tensor shape.
        symmetric: Whether only the upper triangle is sent.

    Returns:
        ``prod(shape)``, or ``prod(shape[:-2]) * n(n+1)/2`` when symmetric.
    """
    if not symmetric:
        numel = 1
        for s in shape:
            numel *= int(s)
        return numel
    n = _check_square(shape)
    batch = 1
    for s in shape[:-2]:
        batch *= int(s)
    return batch * n * (n + 1) // 2


def pack_symmetric(t: torch.Tensor) -> torch.Tensor:
    """Returns the upper triangles of ``t`` (shape ``(..., n, n)``).

    Args:
        t: Symmetric matrix or batch of matrices.

    Returns:
        Tensor of shape ``(..., n(n+1)/2)``.
    """
    n = _check_square(t.shape)
    flat, _ = _triu(n, t.device)
    batch = t.shape[:-2]
    return t.reshape(-1, n * n).index_select(1, flat).reshape(*batch, flat.numel())


def unpack_symmetric(packed: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rebuilds symmetric matrices from their packed upper triangles.

    Args:
        packed: Tensor of shape ``(..., n(n+1)/2)``.
        n: Matrix dimension.
        out: Optional destination of shape ``(..., n, n)``.

    Returns:
        The symmetric matrices, shape ``(..., n, n)``.
    """
    if packed.shape[-1] != n * (n + 1) // 2:
        raise ValueError(f"packed size {packed.shape[-1]} does not match n={n}")
    flat, mask = _triu(n, packed.device)
    batch = packed.shape[:-1]
    upper = packed.new_empty(int(packed[..., 0].numel()), n * n)
    upper.index_copy_(1, flat, packed.reshape(-1, flat.numel()))
    square = upper.view(*batch, n, n)
    full = torch.where(mask, square, square.transpose(-1, -2))
    if out is None:
        return full
    out.copy_(full)
    return out
