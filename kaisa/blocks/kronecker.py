"""One Kronecker product for a sum of them: the factors of a parameter used in two orientations.

A parameter used several times in one step (an embedding tied to the output head) has
one K-FAC term per use, ``K_u = A_u (x) G_u``, all in the same layout, weighted by the
uses' shares of the rows ``w_u``. Their sum ``T = sum_u w_u K_u`` is not a Kronecker
product. :func:`balanced_kronecker` returns the sum of the factors after each use's
scale is split evenly between its two factors (``docs/conventions.md``):

``X = sum_u sqrt(w_u) A_u / pi_u``, ``Y = sum_u sqrt(w_u) pi_u G_u``,
``pi_u = sqrt((tr A_u / n) / (tr G_u / m))`` (``n``, ``m`` the factors' sizes; the
pi of Martens and Grosse's factored damping), so that ``A_u / pi_u`` and ``pi_u G_u``
have the same mean eigenvalue. Then

* ``X (x) Y = T + sum_{u != v} sqrt(w_u w_v) (pi_v / pi_u) A_u (x) G_v``: the cross terms
  are positive semi-definite, so ``X (x) Y`` never has less curvature than ``T`` in any
  direction (a preconditioner built on it never takes a larger step than ``T``'s), and
  ``tr(X (x) Y) = (sum_u sqrt(tr(w_u K_u)))^2 <= k tr(T)`` for ``k`` uses;
* it does not depend on how a use splits its scale between its factors (``c A_u`` and
  ``G_u / c`` give the same ``X``, ``Y``), which a plain sum of the factors would;
* with one use it is that use's ``A`` and ``w G``.

The nearest Kronecker product of ``T`` in the Frobenius norm (Van Loan and Pitsianis)
was tried first: it fits the use with the larger Frobenius norm and can leave directions
that only the other use curves with none (the vocabulary rows of bytes absent from a
batch, which only the head's use curves), and ``kaisa.KFAC`` diverged on the byte GPT.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["balanced_kronecker"]


def balanced_kronecker(
    a: Sequence[torch.Tensor], g: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, Y)``: the pi-balanced sum of the uses' factors (see the module docstring).

    Args:
        a: One A-side factor per use, all ``(n, n)`` or all diagonals ``(n,)``,
            positive semi-definite.
        g: One G-side factor per use, all ``(m, m)`` or all ``(m,)``.
        weights: Non-negative weight per use.

    Returns:
        ``X`` shaped like ``a[0]``, ``Y`` like ``g[0]``. A use whose factors have a zero
        (or non-finite) trace adds nothing; when no use adds anything, ``X`` is the mean of
        ``a`` and ``Y`` the weighted sum of ``g``.

    Raises:
        ValueError: If the lists are empty or of different lengths.
    """
    k = len(a)
    if k == 0 or len(g) != k or len(weights) != k:
        raise ValueError(
            f"balanced_kronecker needs one A, one G and one weight per use, got {len(a)}, "
            f"{len(g)} and {len(weights)}"
        )
    if k == 1:
        return a[0], g[0] * weights[0]
    # on the device, no host synchronisation: per use, the scale of A_u and of G_u
    mean_a = torch.stack([_trace(t) / t.shape[-1] for t in a]).double()
    mean_g = torch.stack([_trace(t) / t.shape[-1] for t in g]).double()
    w = torch.tensor(list(weights), dtype=torch.float64, device=mean_a.device)
    usable = (mean_a > 0) & (mean_g > 0) & torch.isfinite(mean_a * mean_g) & (w > 0)
    pi = torch.where(usable, mean_a / mean_g, torch.ones_like(mean_a)).sqrt()
    root = torch.where(usable, w, torch.zeros_like(w)).sqrt()
    any_usable = usable.any()
    fallback_a = torch.full_like(w, 1.0 / k)  # nothing usable: the mean of the A's
    scale_a = torch.where(any_usable, root / pi, fallback_a).to(a[0].dtype)
    scale_g = torch.where(any_usable, root * pi, w).to(g[0].dtype)
    x = (torch.stack(list(a)) * scale_a.reshape(-1, *[1] * a[0].dim())).sum(0)
    y = (torch.stack(list(g)) * scale_g.reshape(-1, *[1] * g[0].dim())).sum(0)
    return x, y


def _trace(t: torch.Tensor) -> torch.Tensor:
    """The trace of a matrix, or the sum of a diagonal given as a vector."""
    return t.sum() if t.dim() == 1 else t.diagonal().sum()
