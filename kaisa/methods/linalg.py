"""Decompositions of Kronecker factors with the "never corrupt training" fallback ladder.

A decomposition is first computed in the requested dtype (at least float32); if it
raises or returns non-finite values it is retried in float64; if that fails too the
caller gets ``None`` and keeps what it had. Factors of the same size are decomposed in
one batched call. On the CUDA extension the op leaves its status (``info`` and
finiteness, checked on the device) there and a round reads every size group's status in
one host synchronisation; elsewhere each group's results are checked by us.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kaisa import ops
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.finite import all_finite, finite_each

__all__ = [
    "EigenResult",
    "damped_inverses",
    "eigen_decompositions",
    "warm_eigen_decompositions",
]

logger = logging.getLogger("kaisa")


@dataclass
class EigenResult:
    """Eigendecomposition ``Q diag(d) Q^T`` of a batch of factors.

    Attributes:
        eigenvalues: ``(B, n)``, clamped at 0.
        eigenvectors: ``(B, n, n)``, columns are eigenvectors.
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor


def _all_finite(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per-tensor finiteness with a single host synchronisation."""
    if not tensors:
        return []
    return [bool(f) for f in finite_each(tensors).tolist()]


def _eigh(mats: torch.Tensor, dtype: torch.dtype) -> EigenResult | None:
    """One batched attempt; ``None`` if it raised or produced non-finite values."""
    m = mats.to(dtype)
    try:
        evals, evecs = ops.eigh(m)
    except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
        logger.debug("eigh failed in %s: %s", dtype, err)
        return None
    # The CUDA op has checked finiteness in its own (only) host synchronisation.
    if not ops.eigh_checks_finite(m) and not all(_all_finite([evals, evecs])):
        return None
    return EigenResult(evals.clamp_(min=0.0), evecs)


def eigen_decompositions(
    factors: Sequence[torch.Tensor | None],
    *,
    inv_dtype: torch.dtype,
    names: Sequence[str] | None = None,
) -> list[EigenResult | None]:
    """Eigendecompose many factor batches, grouped by size, with the fallback ladder.

    On the CUDA extension (:func:`kaisa.ops.eigh_checks_finite`) every size group is
    queued with :func:`kaisa.ops.eigh_status` and all groups' statuses are read in one
    host synchronisation at the end; elsewhere each group is checked as it completes.
    A factor of a failed group is redone alone (float64 after the requested dtype).

    Args:
        factors: factor batches ``(B_i, n_i, n_i)`` (``None`` entries stay ``None``).
        inv_dtype: storage dtype of the results; decompositions run in
            :func:`kaisa.utils.dtypes.working_dtype` of it.
        names: names for the warnings, one per factor.

    Returns:
        One :class:`EigenResult` (in ``inv_dtype``) or ``None`` (failed) per factor.
    """
    results: list[EigenResult | None] = [None] * len(factors)
    dtype = working_dtype(inv_dtype)
    queued: list[tuple[list[int], EigenResult, torch.Tensor]] = []
    for members in _size_groups(factors).values():
        batch = torch.cat([factors[i] for i in members]).to(dtype)  # type: ignore[misc]
        res: EigenResult | None = None
        if ops.eigh_checks_finite(batch):  # the CUDA op: its status is read below
            try:
                vals, vecs, status = ops.eigh_status(batch)
            except RuntimeError as err:  # a solver call rejected: the group is isolated
                logger.debug("eigh failed in %s: %s", dtype, err)
            else:
                queued.append((members, EigenResult(vals, vecs), status))
                continue
        else:
            res = _eigh(batch, dtype)
        failed = [] if res is not None else list(members)
        _store(results, factors, members, failed, res, inv_dtype)
        _isolate(results, factors, failed, len(members), dtype, inv_dtype, names)
    if queued:
        # the round's only host synchronisation: one flag per matrix of every group
        bad = torch.cat([(s != 0).any(dim=-1) for _, _, s in queued]).tolist()
        offset = 0
        for members, res, _ in queued:
            failed = []
            for i in members:
                blocks = factors[i].shape[0]  # type: ignore[union-attr]
                if any(bad[offset:offset + blocks]):
                    failed.append(i)
                offset += blocks
            res.eigenvalues.clamp_(min=0.0)
            _store(results, factors, members, failed, res, inv_dtype)
            if failed:
                logger.debug("eigh failed in %s for %s", dtype,
                             [_name(names, i) for i in failed])
            _isolate(results, factors, failed, len(members), dtype, inv_dtype, names)
    return results


def _store(
    results: list[EigenResult | None],
    factors: Sequence[torch.Tensor | None],
    members: list[int],
    failed: list[int],
    res: EigenResult | None,
    inv_dtype: torch.dtype,
) -> None:
    """Splits a group's batched result into ``results``, except the ``failed`` members."""
    if res is None or len(failed) == len(members):
        return
    sizes = [factors[i].shape[0] for i in members]  # type: ignore[union-attr]
    vals = _parts(res.eigenvalues.to(inv_dtype), sizes)
    vecs = _parts(res.eigenvectors.to(inv_dtype), sizes)
    for i, v, q in zip(members, vals, vecs, strict=True):
        if i not in failed:
            results[i] = EigenResult(v, q)


def _parts(batch: torch.Tensor, sizes: list[int]) -> Sequence[torch.Tensor]:
    """``batch`` split into its members' results, each its own copy when there are several.

    A view would keep the whole batch alive for as long as any one member's result is
    held (a block that is not restacked with the others, :mod:`kaisa.core.grouped`): the
    decompositions' memory would grow by the rest of its batch.
    """
    if len(sizes) == 1:
        return [batch]
    return [part.clone() for part in torch.split(batch, sizes)]


def _isolate(
    results: list[EigenResult | None],
    factors: Sequence[torch.Tensor | None],
    failed: list[int],
    group_size: int,
    dtype: torch.dtype,
    inv_dtype: torch.dtype,
    names: Sequence[str] | None,
) -> None:
    """Redoes each failed factor alone: in ``dtype`` (if its group had others), then float64."""
    for i in failed:
        f = factors[i]
        assert f is not None
        one = _eigh(f, dtype) if group_size > 1 else None
        if one is None and dtype != torch.float64:
            one = _eigh(f, torch.float64)
            if one is not None:
                logger.warning("eigendecomposition of %s retried in float64", _name(names, i))
        if one is None:
            logger.warning(
                "eigendecomposition of %s failed (non-finite or no convergence); keeping "
                "the previous decomposition", _name(names, i),
            )
            continue
        results[i] = EigenResult(one.eigenvalues.to(inv_dtype), one.eigenvectors.to(inv_dtype))


def warm_eigen_decompositions(
    factors: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor | None],
    *,
    inv_dtype: torch.dtype,
    names: Sequence[str] | None = None,
) -> list[EigenResult | None]:
    """Eigenbases refreshed by one subspace-iteration step from the previous ones.

    Per factor ``F`` with previous basis ``Q0`` (``docs/conventions.md``, "EKFAC"):
    ``P = F Q0``, estimated eigenvalues ``e = diag(Q0^T F Q0)``, columns ordered by ``e``
    descending, ``Q, R = qr(P)`` with each column's sign made that of ``R_jj`` (a converged
    basis maps to itself), then the columns and ``e`` reversed into ascending order (as
    :func:`eigen_decompositions` returns them), ``e`` clamped at 0. Factors without a
    previous basis, and those whose warm start is not finite, are decomposed by
    :func:`eigen_decompositions` (and may fail as there).

    Args:
        factors: Factor batches ``(B_i, n_i, n_i)``.
        previous: Per factor its previous eigenvectors ``(B_i, n_i, n_i)``, or ``None``.
        inv_dtype: Storage dtype of the results (computed in its working dtype).
        names: Names for the warnings.

    Returns:
        One :class:`EigenResult` (in ``inv_dtype``) or ``None`` (failed) per factor.
    """
    results: list[EigenResult | None] = [None] * len(factors)
    dtype = working_dtype(inv_dtype)
    warm = [i for i, q in enumerate(previous) if q is not None]
    done: list[tuple[list[int], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    flags: list[torch.Tensor] = []
    for members in _size_groups([factors[i] if i in warm else None
                                 for i in range(len(factors))]).values():
        sizes = [factors[i].shape[0] for i in members]
        f = torch.cat([factors[i] for i in members]).to(dtype)
        q0 = torch.cat([previous[i] for i in members]).to(dtype)  # type: ignore[misc]
        p = f @ q0
        estimates = (q0 * p).sum(dim=-2)
        order = torch.argsort(estimates, dim=-1, descending=True, stable=True)
        q, r = torch.linalg.qr(torch.take_along_dim(p, order.unsqueeze(-2), dim=-1))
        signs = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(dtype)
        q = (q * signs.unsqueeze(-2)).flip(-1)
        values = torch.take_along_dim(estimates, order, dim=-1).flip(-1).clamp(min=0.0)
        vecs_split, vals_split = torch.split(q, sizes), torch.split(values, sizes)
        finite = finite_each([*vecs_split, *vals_split])
        flags.append(finite.view(2, -1).all(dim=0))
        done.append((members, vals_split, vecs_split))
    ok = torch.cat(flags).tolist() if flags else []  # one host synchronisation for all groups
    for members, vals_split, vecs_split in done:
        good, ok = ok[:len(members)], ok[len(members):]
        for i, fine, vals, vecs in zip(members, good, vals_split, vecs_split, strict=True):
            if fine:
                results[i] = EigenResult(vals.to(inv_dtype), vecs.to(inv_dtype))
    cold = [i for i in range(len(factors)) if results[i] is None]
    if cold:
        if any(i in warm for i in cold):
            logger.debug("warm-started eigenbasis not finite for %s; eigh instead",
                         [_name(names, i) for i in cold if i in warm])
        redone = eigen_decompositions([factors[i] for i in cold], inv_dtype=inv_dtype,
                                      names=[_name(names, i) for i in cold])
        for i, res in zip(cold, redone, strict=True):
            results[i] = res
    return results


def _cholesky_inverse(
    mats: torch.Tensor, damping: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """One batched attempt at ``(mats + damping I)^-1``; ``damping`` is ``(B,)``."""
    m = mats.to(dtype)
    eye = torch.eye(m.shape[-1], dtype=dtype, device=m.device)
    try:
        chol, info = torch.linalg.cholesky_ex(m + damping.to(dtype).reshape(-1, 1, 1) * eye)
        inv = torch.cholesky_inverse(chol)
    except RuntimeError as err:
        logger.debug("cholesky failed in %s: %s", dtype, err)
        return None
    ok = (info == 0).all() & all_finite(inv)
    # LAPACK leaves the (symmetric) inverse column-major: its transpose is the same matrix
    # in row-major order, which receivers and matmuls use without a copy
    return inv.mT if bool(ok) else None


def damped_inverses(
    factors: Sequence[torch.Tensor | None],
    *,
    damping: float | Sequence[float | torch.Tensor],
    inv_dtype: torch.dtype,
    names: Sequence[str] | None = None,
) -> list[torch.Tensor | None]:
    """``(F + damping*I)^-1`` of each factor batch via Cholesky, with the fallback ladder.

    Factors of the same size are inverted in one batched call; if it fails, each factor
    is retried alone (in float64 after the requested dtype), so one bad factor costs only
    its own result.

    Args:
        factors: factor batches ``(B_i, n_i, n_i)`` (``None`` entries stay ``None``).
        damping: added to the diagonal: one number for all, or per factor a number or a
            tensor ``(B_i,)`` of one value per block.
        inv_dtype: storage dtype of the results.
        names: names for the warnings.

    Returns:
        One inverse batch (``inv_dtype``) or ``None`` (failed) per factor.
    """
    dtype = working_dtype(inv_dtype)
    dampings: list[torch.Tensor] = []
    for i, f in enumerate(factors):
        d = damping if isinstance(damping, (int, float)) else damping[i]
        blocks = 0 if f is None else f.shape[0]
        device = None if f is None else f.device
        dampings.append(torch.as_tensor(d, dtype=torch.float64, device=device).expand(blocks))
    out: list[torch.Tensor | None] = [None] * len(factors)
    for members in _size_groups(factors).values():
        sizes = [factors[i].shape[0] for i in members]  # type: ignore[union-attr]
        if len(members) > 1:
            batch = torch.cat([factors[i] for i in members])  # type: ignore[misc]
            inv = _cholesky_inverse(batch, torch.cat([dampings[i] for i in members]), dtype)
            if inv is not None:
                for i, part in zip(members, _parts(inv.to(inv_dtype), sizes), strict=True):
                    out[i] = part
                continue
        for i in members:  # alone: the requested dtype, then float64
            f = factors[i]
            assert f is not None
            one = _cholesky_inverse(f, dampings[i], dtype)
            if one is None and dtype != torch.float64:
                one = _cholesky_inverse(f, dampings[i], torch.float64)
                if one is not None:
                    logger.warning("inverse of %s retried in float64", _name(names, i))
            if one is None:
                logger.warning(
                    "inverse of %s failed; keeping the previous inverse", _name(names, i)
                )
                continue
            out[i] = one.to(inv_dtype)
    return out


def _size_groups(
    factors: Sequence[torch.Tensor | None],
) -> dict[tuple[int, torch.device], list[int]]:
    """Indices of the factors by (size, device), ``None`` entries left out."""
    groups: dict[tuple[int, torch.device], list[int]] = {}
    for i, f in enumerate(factors):
        if f is not None:
            groups.setdefault((f.shape[-1], f.device), []).append(i)
    return groups


def _name(names: Sequence[str] | None, i: int) -> str:
    return f"factor {i}" if names is None else names[i]
