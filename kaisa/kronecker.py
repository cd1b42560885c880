"""One Kronecker product for a sum of them: the factors of a parameter used in two orientations.

A parameter used several times in one step (an embedding tied to the output head) has
one K-FAC term per use, ``K_u = A_u (x) G_u``, all in the same layout. Their weighted
sum ``T = sum_u w_u K_u`` is not a Kronecker product; :func:`nearest_kronecker` returns
the one that is nearest to it in the Frobenius norm (Van Loan and Pitsianis, 1993),
``X (x) Y`` with ``X = sum_u a_u A_u`` and ``Y = sum_u b_u G_u``:

* rearranged, ``T`` is the matrix ``sum_u w_u vec(A_u) vec(G_u)^T`` of rank at most
  ``k`` (the number of uses); its best rank-one approximation lies in the span of the
  ``vec(A_u)`` and the ``vec(G_u)``, so it needs only the ``k x k`` Gram matrices
  ``P_uv = <A_u, A_v>`` and ``Q_uv = w_u w_v <G_u, G_v>`` (Frobenius inner products);
* ``a`` is the Perron eigenvector of ``Q P`` (both have non-negative entries for
  positive semi-definite factors, so ``a >= 0`` and ``X`` is positive semi-definite),
  scaled so that ``sum_u a_u = 1``: ``X`` is a convex combination of the uses' A
  factors, and with one use ``X = A_1``;
* ``Y`` is then the best partner of ``X``: ``Y = sum_u w_u (<A_u, X> / <X, X>) G_u``
  (with one use and ``w = 1``, ``Y = G_1``).

A factor given as a vector is a diagonal matrix (its inner products are those of the
diagonals). The result does not depend on how each use splits its scale between its
two factors (``c A_u (x) G_u / c`` gives the same ``X (x) Y``), which a plain sum of the
factors would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["nearest_kronecker"]


def nearest_kronecker(
    a: Sequence[torch.Tensor], g: Sequence[torch.Tensor], weights: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, Y)`` with ``X (x) Y`` nearest to ``sum_u weights[u] a[u] (x) g[u]``.

    Args:
        a: One A-side factor per use, all ``(n, n)`` or all diagonals ``(n,)``,
            positive semi-definite.
        g: One G-side factor per use, all ``(m, m)`` or all ``(m,)``.
        weights: Non-negative weight per use.

    Returns:
        ``X`` shaped like ``a[0]`` (a convex combination of ``a``) and ``Y`` shaped like
        ``g[0]`` (a non-negative combination of ``g``). Where every weighted term is
        zero, ``X`` is the mean of ``a`` and ``Y`` is zero.

    Raises:
        ValueError: If the lists are empty or of different lengths.
    """
    k = len(a)
    if k == 0 or len(g) != k or len(weights) != k:
        raise ValueError(
            f"nearest_kronecker needs one A, one G and one weight per use, got {len(a)}, "
            f"{len(g)} and {len(weights)}"
        )
    if k == 1:
        return a[0], g[0] * weights[0]
    dtype = torch.float64
    flat_a = torch.stack([t.reshape(-1) for t in a]).to(dtype)
    w = torch.tensor(list(weights), dtype=dtype, device=flat_a.device)
    flat_g = torch.stack([t.reshape(-1) for t in g]).to(dtype) * w[:, None]
    p = flat_a @ flat_a.T
    q = flat_g @ flat_g.T
    coef = _perron_vector(q @ p)
    x = (coef.to(a[0].dtype)[:, None] * flat_a.to(a[0].dtype)).sum(0).reshape(a[0].shape)
    xx = (coef @ p @ coef)
    if not bool(xx > 0):
        return torch.stack(list(a)).mean(0), torch.zeros_like(g[0])
    beta = (p @ coef) / xx * w  # <A_u, X> / <X, X>, weighted
    y = (beta.to(g[0].dtype)[:, None] * torch.stack([t.reshape(-1) for t in g])).sum(0)
    return x, y.reshape(g[0].shape)


def _perron_vector(m: torch.Tensor) -> torch.Tensor:
    """The eigenvector of the largest eigenvalue of a non-negative ``k x k`` matrix, summing to 1.

    ``m = Q P`` with both positive semi-definite, so its eigenvalues are real and
    non-negative; the vector is taken non-negative (Perron-Frobenius) and, when ``m``
    is zero, uniform.
    """
    k = m.shape[0]
    if not bool(m.abs().max() > 0):
        return torch.full((k,), 1.0 / k, dtype=m.dtype, device=m.device)
    values, vectors = torch.linalg.eig(m)
    top = int(torch.argmax(values.real))
    v = vectors[:, top].real
    v = v * torch.sign(v.sum())  # the Perron vector is non-negative up to sign
    v = v.clamp(min=0)
    out: torch.Tensor = v / v.sum()
    return out
