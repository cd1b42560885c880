"""K-FAC kernels with a C++/CUDA extension backend and a pure-PyTorch fallback.

Two backends implement the same functions:

* ``'ext'``: the compiled ``kaisa._C`` extension (ops registered under the
  ``torch.ops.kaisa`` namespace; CPU kernels and, when built with CUDA, GPU
  kernels).
* ``'torch'``: the reference implementations in :mod:`kaisa.ops._reference`.

At import the backend is chosen from the ``KAISA_BACKEND`` environment
variable (``'torch'`` or ``'ext'``). When it is unset the extension is used if
it loads, otherwise the torch backend is used and a single
:class:`RuntimeWarning` names the load error. ``KAISA_BACKEND=ext`` with an
extension that cannot be loaded raises :class:`ImportError`.

Every function validates its inputs (raising :class:`ValueError` or
:class:`TypeError` naming the offending argument) and never modifies its
inputs, except ``running`` in the ``*_ema_`` functions. With the ext backend,
tensors on a device the extension has no kernel for (e.g. CUDA tensors with a
CPU-only build) use the reference implementation (one RuntimeWarning per op and
device type).
"""

from __future__ import annotations

import torch

from kaisa.ops import _reference
from kaisa.ops._backend import (
    BACKENDS,
    _use_ext,
    backend,
    extension_available,
    extension_error,
    set_backend,
    use_backend,
)
from kaisa.ops._checks import (
    _check_eigen_args,
    _check_float_tensor,
    _check_running,
    _check_scalar,
    _conv_args,
    _conv_dim,
)

__all__ = [
    "BACKENDS",
    "backend",
    "conv_covariance",
    "conv_covariance_ema_",
    "covariance",
    "covariance_ema_",
    "eigen_precondition",
    "eigh",
    "extension_available",
    "extension_error",
    "set_backend",
    "use_backend",
]


def covariance(x: torch.Tensor, scale: float, *, bias: bool = False) -> torch.Tensor:
    """Computes the factor ``scale * Xb^T Xb`` with ``Xb = [x | 1]`` when ``bias``.

    The extension accumulates only upper-triangle blocks (in float32, or
    float64 for double inputs) without materialising the ones column and
    mirrors the result, so it is exactly symmetric.

    Args:
        x: (rows, d) floating point tensor; may be non-contiguous.
        scale: multiplier applied to the Gram matrix (e.g. ``1 / rows``).
        bias: whether to append a column of ones to ``x``.

    Returns:
        (d + bias, d + bias) tensor with the dtype and device of ``x``.

    Raises:
        TypeError: if ``x`` is not a floating point tensor.
        ValueError: if ``x`` is not 2-D.
    """
    xt = _check_float_tensor(x, "x", (2,))
    s = _check_scalar(scale, "scale")
    if _use_ext("covariance", xt.device):
        out: torch.Tensor = torch.ops.kaisa.covariance(xt, s, bool(bias))
        return out
    return _reference.covariance(xt, s, bias=bool(bias))


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
    """Computes the per-group A factors of a 2D convolution from its input.

    The patches are exactly those of ``F.unfold(x, kernel_size, dilation,
    padding, stride)``; for group ``k`` the columns are input channels
    ``k*C/g .. (k+1)*C/g`` ordered channel slowest, then kernel row, then kernel
    column (the order of ``weight.view(out_channels, -1)``), followed by a ones
    column when ``bias``. The extension never materialises the whole patch
    matrix: it unfolds tiles of images into a reused buffer and accumulates
    upper-triangle blocks.

    Args:
        x: (N, C, H, W) convolution input.
        kernel_size: (kh, kw).
        stride: (sh, sw).
        padding: symmetric zero padding (ph, pw).
        dilation: (dh, dw).
        groups: number of convolution groups; must divide C.
        bias: whether the convolution has a bias.
        scale: multiplier applied to each Gram matrix.

    Returns:
        Exactly symmetric (groups, d, d) tensor, ``d = C / groups * kh * kw + bias``,
        equal to ``scale * Pb_k^T Pb_k`` with ``N * out_h * out_w`` patch rows.

    Raises:
        TypeError: if ``x`` is not a floating point tensor.
        ValueError: on bad shapes or convolution parameters.
    """
    xt, ks, st, pd, dl, g = _conv_args(x, kernel_size, stride, padding, dilation, groups)
    s = _check_scalar(scale, "scale")
    if _use_ext("conv_covariance", xt.device):
        out: torch.Tensor = torch.ops.kaisa.conv_covariance(
            xt, list(ks), list(st), list(pd), list(dl), g, bool(bias), s
        )
        return out
    return _reference.conv_covariance(xt, ks, st, pd, dl, g, bool(bias), s)


def covariance_ema_(
    running: torch.Tensor,
    x: torch.Tensor,
    scale: float,
    *,
    bias: bool = False,
    rho: float,
) -> None:
    """Updates ``running = rho * running + (1 - rho) * covariance(x, scale, bias=bias)``.

    The extension fuses the update: the batch factor is accumulated directly
    into ``running`` (no separate batch tensor when ``running`` is contiguous
    float32/float64).

    Args:
        running: (d + bias, d + bias) running factor, updated in place.
        x: (rows, d) floating point tensor.
        scale: multiplier applied to the batch Gram matrix.
        bias: whether to append a column of ones to ``x``.
        rho: decay of the running average.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if ``running`` does not have the factor's shape.
    """
    xt = _check_float_tensor(x, "x", (2,))
    d = xt.shape[1] + int(bool(bias))
    r = _check_running(running, (d, d), xt)
    s = _check_scalar(scale, "scale")
    rh = _check_scalar(rho, "rho")
    if _use_ext("covariance_ema_", xt.device):
        torch.ops.kaisa.covariance_ema_(r, xt, s, bool(bias), rh)
        return
    _reference.covariance_ema_(r, xt, s, bias=bool(bias), rho=rh)


def conv_covariance_ema_(
    running: torch.Tensor,
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
    bias: bool,
    scale: float,
    rho: float,
) -> None:
    """Updates ``running = rho * running + (1 - rho) * conv_covariance(...)`` in place.

    Args:
        running: (groups, d, d) running factor, updated in place.
        x: (N, C, H, W) convolution input.
        kernel_size: (kh, kw).
        stride: (sh, sw).
        padding: symmetric zero padding (ph, pw).
        dilation: (dh, dw).
        groups: number of convolution groups.
        bias: whether the convolution has a bias.
        scale: multiplier applied to the batch Gram matrices.
        rho: decay of the running average.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: on bad shapes or convolution parameters.
    """
    xt, ks, st, pd, dl, g = _conv_args(x, kernel_size, stride, padding, dilation, groups)
    d = _conv_dim(xt, ks, g, bool(bias))
    r = _check_running(running, (g, d, d), xt)
    s = _check_scalar(scale, "scale")
    rh = _check_scalar(rho, "rho")
    if _use_ext("conv_covariance_ema_", xt.device):
        torch.ops.kaisa.conv_covariance_ema_(
            r, xt, list(ks), list(st), list(pd), list(dl), g, bool(bias), s, rh
        )
        return
    _reference.conv_covariance_ema_(r, xt, ks, st, pd, dl, g, bool(bias), s, rh)


def eigen_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    *,
    da: torch.Tensor | None = None,
    dg: torch.Tensor | None = None,
    dgda: torch.Tensor | None = None,
    damping: float = 0.0,
) -> torch.Tensor:
    """Preconditions gradients with eigendecomposed Kronecker factors.

    Computes ``QG ((QG^T grad QA) / (dg da^T + damping)) QA^T``, or
    ``QG ((QG^T grad QA) * dgda) QA^T`` when the inverse denominators ``dgda``
    are precomputed. The extension fuses the division between the products.

    Args:
        grad: (B, m, n) or (m, n) gradient.
        qa: (B, n, n) or (n, n) eigenvectors of the A factor.
        qg: (B, m, m) or (m, m) eigenvectors of the G factor.
        da: (B, n) or (n,) eigenvalues of A (with ``dg``; excludes ``dgda``).
        dg: (B, m) or (m,) eigenvalues of G (with ``da``; excludes ``dgda``).
        dgda: (B, m, n) or (m, n) precomputed ``1 / (dg da^T + damping)``.
        damping: damping added to ``dg da^T`` (ignored with ``dgda``).

    Returns:
        Preconditioned gradient with the shape and dtype of ``grad``.

    Raises:
        TypeError: if an argument is not a floating point tensor.
        ValueError: on shape, dtype or device mismatch, or unless exactly one of
            ``(da, dg)`` and ``dgda`` is given.
    """
    _check_eigen_args(grad, qa, qg, da, dg, dgda)
    damp = _check_scalar(damping, "damping")
    if _use_ext("eigen_precondition", grad.device):
        out: torch.Tensor = torch.ops.kaisa.eigen_precondition(grad, qa, qg, da, dg, dgda, damp)
        return out
    return _reference.eigen_precondition(grad, qa, qg, da, dg, dgda, damp)


def eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched symmetric eigendecomposition, like :func:`torch.linalg.eigh`.

    Only the lower triangle of each matrix is read.

    Args:
        a: (B, n, n) or (n, n) symmetric matrices.

    Returns:
        Tuple ``(eigenvalues, eigenvectors)`` of shapes (B, n) and (B, n, n)
        (or (n,) and (n, n)); eigenvalues are ascending and the eigenvectors
        are the columns of the second tensor.

    Raises:
        TypeError: if ``a`` is not a floating point tensor.
        ValueError: if ``a`` is not a (batch of) square matrices.
    """
    t = _check_float_tensor(a, "a", (2, 3))
    if t.shape[-1] != t.shape[-2]:
        raise ValueError(f"a must hold square matrices, got shape {tuple(t.shape)}")
    if _use_ext("batched_eigh", t.device):
        if t.dim() == 2:  # the op contract is (B, n, n)
            vals, vecs = torch.ops.kaisa.batched_eigh(t.unsqueeze(0))
            return vals.squeeze(0), vecs.squeeze(0)
        vals, vecs = torch.ops.kaisa.batched_eigh(t)
        return vals, vecs
    return _reference.eigh(t)
