"""The query side of the scores: preconditioned query gradients, whole or of low rank.

A block's preconditioned query gradients ``P(G_q)`` ``(Q, groups, rows, columns)`` are
kept whole, or (``query_rank=k``, Kronfluence's ``query_gradient_low_rank``) as the
``k`` leading terms of each matrix's singular value decomposition, ``U_k S_k`` and
``V_k^T``: ``k (rows + columns)`` numbers per matrix instead of ``rows x columns``; the
scores are then those of the truncated matrices (``docs/conventions.md``, "Influence").
:func:`token_terms` splits a training example's score into its rows' terms (per-token
scores).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kaisa.influence.rows import Part, Unreached

__all__ = ["Queries", "check_rank", "query_shape", "summed", "token_terms"]

#: Queries scored at once by :func:`token_terms` (bounds its intermediate products).
TOKEN_CHUNK = 8


def check_rank(rank: int | None) -> int | None:
    """``rank`` (a ``query_rank``: ``None`` or a positive integer), or ``ValueError``."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"query_rank must be a positive integer or None, got {rank!r}")
    return rank


@dataclass
class Queries:
    """One block's preconditioned query gradients: whole, or ``left @ right`` (rank ``k``)."""

    whole: torch.Tensor | None = None
    left: torch.Tensor | None = None  # (Q, groups, rows, k): U_k S_k
    right: torch.Tensor | None = None  # (Q, groups, k, columns): V_k^T

    @classmethod
    def of(cls, p: torch.Tensor, rank: int | None) -> Queries:
        """``p`` kept whole (``rank=None``) or as its rank-``rank`` truncation.

        Raises:
            ValueError: ``rank`` is not a positive integer.
        """
        if check_rank(rank) is None:
            return cls(whole=p)
        assert rank is not None
        u, s, vh = torch.linalg.svd(p, full_matrices=False)
        k = min(rank, s.shape[-1])
        return cls(left=u[..., :k] * s[..., None, :k], right=vh[..., :k, :])

    @property
    def count(self) -> int:
        """The queries."""
        held = self.whole if self.whole is not None else self.left
        assert held is not None
        return int(held.shape[0])

    def dense(self) -> torch.Tensor:
        """The matrices ``(Q, groups, rows, columns)`` (rebuilt from the low-rank terms)."""
        if self.whole is not None:
            return self.whole
        assert self.left is not None and self.right is not None
        return self.left @ self.right


def summed(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The sum of one or more tensors (the first not copied)."""
    it = iter(tensors)
    total = next(it)
    for t in it:
        total = total + t
    return total


def query_shape(count: int, shape: tuple[int, ...], field: str, rank: int | None
                ) -> tuple[int, ...]:
    """The shape of ``count`` queries' ``field`` (:class:`Queries`) of a block's matrices."""
    groups, rows, cols = shape
    if field == "whole" or rank is None:
        return count, groups, rows, cols
    k = min(rank, rows, cols)
    return (count, groups, rows, k) if field == "left" else (count, groups, k, cols)


def token_terms(parts: Mapping[str, Sequence[Part]], queries: Mapping[str, torch.Tensor]
                ) -> torch.Tensor:
    """Each training example's rows' terms of its score, ``(Q, N, R)``, over all parts.

    ``queries``: each block's matrices ``(Q, groups, rows, columns)``.

    Raises:
        ValueError: The parts have different numbers of rows per example.
    """
    total: torch.Tensor | None = None
    rows: int | None = None
    for name, pieces in parts.items():
        p = queries[name]
        for part in pieces:
            terms = torch.cat([part.per_row(p[i:i + TOKEN_CHUNK])
                               for i in range(0, p.shape[0], TOKEN_CHUNK)])
            if not isinstance(part, Unreached):  # zeros broadcast over any rows
                if rows is not None and terms.shape[-1] != rows:
                    raise ValueError(
                        "per-token scores need every scored layer's rows to be the same "
                        f"positions; layer {name!r} has {terms.shape[-1]} rows per example, "
                        f"another {rows}")
                rows = terms.shape[-1]
            total = terms if total is None else total + terms
    assert total is not None
    return total
