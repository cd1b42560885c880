"""Pure-PyTorch reference implementations of the :mod:`kaisa.ops` kernels.

These functions define the semantics of every op. They favour clarity over
speed (the conv factor materialises the whole patch matrix with
:func:`torch.nn.functional.unfold`) and are used as the ``'torch'`` backend and
as the ground truth the C++ extension is tested against.

Inputs are assumed to be validated by the caller (:mod:`kaisa.ops`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kaisa.ops._checks import ConvArgs
from kaisa.utils.dtypes import working_dtype

__all__ = [
    "conv_covariance",
    "conv_patches",
    "covariance",
    "eigen_precondition",
    "eigh",
    "eigh_status",
    "fold",
    "fold_many",
]


def _symmetrize(c: torch.Tensor) -> torch.Tensor:
    """Makes the last two dims exactly symmetric by mirroring the upper triangle."""
    upper = torch.triu(c)
    return upper + torch.triu(c, diagonal=1).transpose(-1, -2)


def covariance(x: torch.Tensor, scale: float, *, bias: bool = False) -> torch.Tensor:
    """Computes ``scale * Xb^T Xb`` with ``Xb = [x | 1]`` when ``bias``.

    Args:
        x: (rows, d) floating point tensor.
        scale: multiplier applied to the Gram matrix.
        bias: whether to append a column of ones to ``x``.

    Returns:
        Exactly symmetric (d + bias, d + bias) tensor with the dtype of ``x``.
    """
    acc = working_dtype(x.dtype)
    xa = x.to(acc)
    if bias:
        xa = torch.cat([xa, xa.new_ones(xa.shape[0], 1)], dim=1)
    c = (xa.t() @ xa) * scale
    return _symmetrize(c).to(x.dtype)


def conv_patches(x: torch.Tensor, conv: ConvArgs, bias: bool) -> torch.Tensor:
    """Builds the per-group patch matrices of a 2D convolution input.

    Args:
        x: (N, C, H, W) input of the convolution.
        conv: its kernel size, stride, padding, dilation and groups.
        bias: whether to append a ones column (last) to each patch matrix.

    Returns:
        (groups, N * out_h * out_w, C / groups * kh * kw + bias) tensor whose
        column order is channel slowest, then kernel row, then kernel column.
    """
    n, c = x.shape[0], x.shape[1]
    kernel_size, stride, padding, dilation, groups = conv
    cols = F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    per_group = c // groups * kernel_size[0] * kernel_size[1]
    length = cols.shape[-1]
    p = cols.view(n, groups, per_group, length).permute(1, 0, 3, 2)
    p = p.reshape(groups, n * length, per_group)
    if bias:
        p = torch.cat([p, p.new_ones(groups, n * length, 1)], dim=2)
    return p


def conv_covariance(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    bias: bool,
    scale: float,
) -> torch.Tensor:
    """Computes the per-group Gram matrices ``scale * Pb_k^T Pb_k`` of conv patches.

    Args:
        x: (N, C, H, W) input of the convolution.
        kernel_size: (kh, kw).
        stride: (sh, sw).
        padding: symmetric zero padding (ph, pw).
        dilation: (dh, dw).
        groups: number of convolution groups.
        bias: whether the patch matrices get a trailing ones column.
        scale: multiplier applied to each Gram matrix.

    Returns:
        Exactly symmetric (groups, d, d) tensor, ``d = C / groups * kh * kw + bias``.
    """
    acc = working_dtype(x.dtype)
    conv = ConvArgs(kernel_size, stride, padding, dilation, groups)
    p = conv_patches(x.to(acc), conv, bias)
    c = torch.bmm(p.transpose(1, 2), p) * scale
    return _symmetrize(c).to(x.dtype)


def eigen_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    da: torch.Tensor | None,
    dg: torch.Tensor | None,
    dgda: torch.Tensor | None,
    damping: float,
) -> torch.Tensor:
    """Preconditions ``grad`` with the eigendecompositions of the K-FAC factors.

    Computes ``QG ((QG^T grad QA) / (dg da^T + damping)) QA^T`` or, when
    ``dgda`` is given, ``QG ((QG^T grad QA) * dgda) QA^T``.

    Args:
        grad: (B, m, n) or (m, n) gradient.
        qa: (B, n, n) or (n, n) eigenvectors of the A factor.
        qg: (B, m, m) or (m, m) eigenvectors of the G factor.
        da: (B, n) or (n,) eigenvalues of A, or None when ``dgda`` is given.
        dg: (B, m) or (m,) eigenvalues of G, or None when ``dgda`` is given.
        dgda: (B, m, n) or (m, n) precomputed ``1 / (dg da^T + damping)``.
        damping: damping added to the eigenvalue outer product.

    Returns:
        Preconditioned gradient, same shape and dtype as ``grad``.
    """
    v = qg.transpose(-1, -2) @ grad @ qa
    if dgda is not None:
        v = v * dgda
    else:
        assert da is not None and dg is not None
        v = v / (dg.unsqueeze(-1) * da.unsqueeze(-2) + damping)
    return qg @ v @ qa.transpose(-1, -2)


def eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched symmetric eigendecomposition (ascending eigenvalues).

    Args:
        a: (..., n, n) symmetric matrices.

    Returns:
        Tuple of eigenvalues (..., n) and eigenvectors (..., n, n).
    """
    vals, vecs = torch.linalg.eigh(a)
    return vals, vecs


def eigh_status(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`eigh` that reports failures in a status tensor instead of raising.

    Args:
        a: (n, n) or (B, n, n) symmetric matrices.

    Returns:
        Eigenvalues, eigenvectors (as :func:`eigh`) and an int32 status ``a.shape[:-2] +
        (2,)``: per matrix ``[info, non-finite]``, ``info`` 1 where the solver raised (its
        results are then NaN), ``non-finite`` 1 where the matrix or a result is not finite.
    """
    batch = a if a.dim() == 3 else a.unsqueeze(0)
    vals = batch.new_empty(batch.shape[:-1])
    vecs = batch.new_empty(batch.shape)
    info = torch.zeros(batch.shape[0], dtype=torch.int32, device=a.device)
    for b in range(batch.shape[0]):
        try:
            vals[b], vecs[b] = torch.linalg.eigh(batch[b])
        except RuntimeError:  # torch.linalg.LinAlgError
            info[b] = 1
            vals[b], vecs[b] = math.nan, math.nan
    finite = torch.isfinite(vals).all(-1) & torch.isfinite(vecs).flatten(1).all(-1)
    finite &= torch.isfinite(batch).flatten(1).all(-1)
    status = torch.stack([info, (~finite).to(torch.int32)], dim=1)
    if a.dim() == 2:
        return vals[0], vecs[0], status[0]
    return vals, vecs, status


def fold(
    running: torch.Tensor, batch: torch.Tensor, stamp: torch.Tensor, skipped: torch.Tensor,
    round_: int, decay: float, weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One micro-batch factor folded into a running factor (see :func:`kaisa.ops.fold`).

    Where ``batch`` is finite: ``running * s + batch * weight`` with ``s = decay`` unless
    ``stamp == round_`` (then ``s = 1``), and the stamp becomes ``round_``; else
    ``running`` and the stamp, and ``skipped + 1``.
    """
    finite = torch.isfinite(batch).all()
    rho = torch.full((), decay, dtype=running.dtype, device=running.device)
    scale = torch.where(stamp != round_, rho, torch.ones_like(rho))
    updated = running * scale + batch * weight
    return (torch.where(finite, updated, running),
            torch.where(finite, torch.full_like(stamp, round_), stamp),
            skipped + (~finite).to(skipped.dtype))


def fold_many(
    running: list[torch.Tensor], batch: list[torch.Tensor], stamp: list[torch.Tensor],
    skipped: list[torch.Tensor], round_: int, decay: float, weight: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`fold` of each tensor of the lists (see :func:`kaisa.ops.fold_many`)."""
    outs: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]] = ([], [], [])
    for r, b, st, sk in zip(running, batch, stamp, skipped, strict=True):
        for out, t in zip(outs, fold(r, b, st, sk, round_, decay, weight), strict=True):
            out.append(t)
    return outs
