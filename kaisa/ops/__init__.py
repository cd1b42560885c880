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
inputs. The compiled kernels re-check the same contract (one C++ check per op,
shared by the CPU and CUDA kernels). Each op's fake kernel (its output shapes
for ``torch.compile``/FakeTensor, checked with :func:`torch._check`) sits right
below its wrapper and is registered when the extension loads. With the ext backend,
tensors on a device the extension has no kernel for (e.g. CUDA tensors with a
CPU-only build) use the reference implementation (one RuntimeWarning per op and
device type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kaisa.ops import _backend, _reference, _shifted
from kaisa.ops._backend import (
    BACKENDS,
    _use_ext,
    backend,
    cuda_kernels_error,
    extension_available,
    extension_error,
    kernels,
    set_backend,
    use_backend,
)
from kaisa.ops._checks import (
    ConvArgs,
    _check_eigen_args,
    _check_float_tensor,
    _check_fold_args,
    _check_scalar,
    _conv_args,
)
from kaisa.ops._overflow import prescaled, rescaled

__all__ = [
    "BACKENDS",
    "OPS",
    "backend",
    "channel_covariance",
    "conv_covariance",
    "covariance",
    "cuda_kernels_error",
    "eigen_precondition",
    "eigh",
    "eigh_checks_finite",
    "eigh_status",
    "extension_available",
    "extension_error",
    "fold",
    "fold_many",
    "kernels",
    "prescaled",
    "rescaled",
    "set_backend",
    "use_backend",
]

_FAKES: dict[str, Callable[..., object]] = {}


def _require(condition: bool, message: Callable[[], str]) -> None:
    """:func:`torch._check` (symbolic-shape aware; raises RuntimeError) for the fakes."""
    torch._check(condition, message)  # type: ignore[no-untyped-call]


def _fake(op: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Marks a function as the fake kernel of ``torch.ops.kaisa.<op>``."""

    def register(fn: Callable[..., object]) -> Callable[..., object]:
        _FAKES[op] = fn
        return fn

    return register


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
    if _guards_itself("covariance", xt.device):
        return torch.ops.kaisa.covariance(xt, s, bool(bias))  # type: ignore[no-any-return]
    xt, f = prescaled(xt, xt.shape[0], s)  # a finite result whose sum would overflow
    if _use_ext("covariance", xt.device):
        out: torch.Tensor = torch.ops.kaisa.covariance(xt, s, bool(bias))
    else:
        out = _reference.covariance(xt, s, bias=bool(bias))
    return rescaled(out, f, bias=bool(bias))


@_fake("covariance")
def _covariance_fake(x: torch.Tensor, scale: float, bias: bool) -> torch.Tensor:
    _require(x.dim() == 2, lambda: f"kaisa covariance: x must be 2-D, got {x.dim()}-D")
    d = x.shape[1] + int(bias)
    return x.new_empty((d, d))


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
    upper-triangle blocks. On the CPU, the ext backend computes a stride-1,
    dilation-1, one-group float32/float64 factor from shifted channel
    correlations instead (:mod:`kaisa.ops._shifted`; equal up to float rounding).

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
    xt, conv = _conv_args(x, kernel_size, stride, padding, dilation, groups)
    s = _check_scalar(scale, "scale")
    if _guards_itself("conv_covariance", xt.device):
        ks, st, pd, dl, g = conv
        return torch.ops.kaisa.conv_covariance(  # type: ignore[no-any-return]
            xt, list(ks), list(st), list(pd), list(dl), g, bool(bias), s)
    oh, ow = conv.output_size(xt.shape[2], xt.shape[3])
    xt, f = prescaled(xt, xt.shape[0] * oh * ow, s)
    if _shifted_path(xt, conv):
        out: torch.Tensor = _shifted.conv_covariance_shifted(
            xt, conv.kernel_size, conv.padding, bool(bias), s)
    elif _use_ext("conv_covariance", xt.device):
        ks, st, pd, dl, g = conv
        out = torch.ops.kaisa.conv_covariance(
            xt, list(ks), list(st), list(pd), list(dl), g, bool(bias), s
        )
    else:
        out = _reference.conv_covariance(xt, *conv, bool(bias), s)
    return rescaled(out, f, bias=bool(bias))


def channel_covariance(x: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """Per-group Gram matrices of the channels of ``x`` over its batch and positions.

    ``scale * D_k^T D_k`` with ``D = x.permute(0, 2, 3, 1).reshape(N*H*W, C)`` and ``D_k``
    its columns ``k*C/g .. (k+1)*C/g``: a convolution's G factors from its output gradient.
    On a GPU (any device but the CPU) this is :func:`conv_covariance` with a 1x1 kernel,
    which reads the rows in place: one kernel, no copy. On the CPU ``D`` is copied once and
    each group is :func:`covariance` (one group) or one batched product, as the CPU's
    factors have always been computed: the 1x1 kernel there sums per image, in another
    order, and float64 trajectories would change in their last bits.

    Args:
        x: ``(N, C, H, W)`` floating point tensor.
        groups: Groups of channels (divides ``C``).
        scale: Multiplier of each Gram matrix.

    Returns:
        Exactly symmetric ``(groups, C/groups, C/groups)`` tensor of ``x``'s dtype.

    Raises:
        TypeError: if ``x`` is not a floating point tensor.
        ValueError: on bad shapes or ``groups``.
    """
    xt, conv = _conv_args(x, (1, 1), (1, 1), (0, 0), (1, 1), groups)
    s = _check_scalar(scale, "scale")
    if xt.device.type != "cpu":
        return conv_covariance(xt, (1, 1), (1, 1), (0, 0), (1, 1), groups, False, s)
    n, c, h, w = xt.shape
    d = xt.permute(0, 2, 3, 1).reshape(n * h * w, c)
    if conv.groups == 1:
        return covariance(d, s).unsqueeze(0)
    m = c // conv.groups
    d, f = prescaled(d, n * h * w, s)  # as covariance: no overflow before the scale
    dg = d.reshape(n * h * w, conv.groups, m).transpose(0, 1)  # (groups, N*H*W, m)
    out = torch.bmm(dg.transpose(1, 2), dg).mul_(s)
    return rescaled((out + out.transpose(1, 2)).mul_(0.5), f, bias=False)


def _guards_itself(op: str, device: torch.device) -> bool:
    """Whether ``op``'s kernel on ``device`` applies the overflow guard itself.

    The CUDA kernels do (``csrc/cuda/covariance.cu``: the factor read on the device from
    one ``aminmax``, applied as the elements are loaded, no copy of the input); elsewhere
    :func:`prescaled` and :func:`rescaled` wrap the kernel.
    """
    return device.type == "cuda" and _use_ext(op, device)


def _shifted_path(x: torch.Tensor, conv: ConvArgs) -> bool:
    """Whether the ext backend computes this conv factor by shifted correlations.

    On the CPU, the factor of a stride-1, dilation-1, one-group convolution with a kernel
    larger than 1x1, large enough for it to pay (:func:`kaisa.ops._shifted.supports_shifted`),
    is :func:`kaisa.ops._shifted.conv_covariance_shifted` (13 GEMMs of
    ``C`` columns for a 3x3 kernel instead of the compiled kernel's SYRK of ``9 C``
    columns; ``bench/kernels/conv_factor.py`` times both). Its planning is in Python ints (no host
    synchronisation), so ``torch.compile`` traces it (tests/ops/test_conv_shifted.py).
    """
    return _use_ext("conv_covariance", x.device) and _shifted.supports_shifted(x, conv)


@_fake("conv_covariance")
def _conv_covariance_fake(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    bias: bool,
    scale: float,
) -> torch.Tensor:
    _require(x.dim() == 4, lambda: f"kaisa conv_covariance: x must be 4-D, got {x.dim()}-D")
    _require(
        groups >= 1 and x.shape[1] % groups == 0,
        lambda: f"kaisa conv_covariance: groups ({groups}) must divide C ({x.shape[1]})",
    )
    d = x.shape[1] // groups * kernel_size[0] * kernel_size[1] + int(bias)
    return x.new_empty((groups, d, d))


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


@_fake("eigen_precondition")
def _eigen_precondition_fake(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    da: torch.Tensor | None,
    dg: torch.Tensor | None,
    dgda: torch.Tensor | None,
    damping: float,
) -> torch.Tensor:
    lead = tuple(grad.shape[:-2])
    m, n = grad.shape[-2], grad.shape[-1]
    _require(grad.dim() in (2, 3), lambda: "kaisa eigen_precondition: grad must be 2 or 3-D")
    _require(tuple(qa.shape) == (*lead, n, n), lambda: "kaisa eigen_precondition: qa shape")
    _require(tuple(qg.shape) == (*lead, m, m), lambda: "kaisa eigen_precondition: qg shape")
    _require(
        (dgda is None) != (da is None and dg is None),
        lambda: "kaisa eigen_precondition: give exactly one of (da, dg) and dgda",
    )
    return grad.new_empty(grad.shape)


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
    if _eigh_on_ext(t):
        vals, vecs = torch.ops.kaisa.batched_eigh(t)
        return vals, vecs
    return _reference.eigh(t)


def eigh_checks_finite(a: torch.Tensor) -> bool:
    """Whether :func:`eigh` of ``a`` raises unless its results are finite.

    True where the CUDA kernel of ``kaisa::batched_eigh`` runs: it checks the solver's
    ``info`` and the finiteness of every eigenvalue and eigenvector on the device, in its
    one host synchronisation, and raises :class:`torch.linalg.LinAlgError` otherwise
    (``csrc/SCHEMAS.md``), so a caller's own check would only add a second
    synchronisation. The CPU kernel and the reference make no such promise. Where it is
    true, :func:`eigh_status` runs the same kernel without the synchronisation (its
    status covers ``info`` and finiteness), which :mod:`kaisa.methods.linalg` uses to read a
    whole decomposition round's statuses at once.

    Args:
        a: the (batch of) matrices :func:`eigh` is given.
    """
    return a.device.type == "cuda" and _eigh_on_ext(a)


def _eigh_on_ext(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float32, torch.float64) and _use_ext("batched_eigh", t.device)


@_fake("batched_eigh")
def _batched_eigh_fake(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _require(a.dim() in (2, 3), lambda: "kaisa batched_eigh: a must be (n, n) or (B, n, n)")
    _require(a.shape[-1] == a.shape[-2], lambda: "kaisa batched_eigh: a must be square")
    return a.new_empty(a.shape[:-1]), a.new_empty(a.shape)


def eigh_status(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`eigh` without a host synchronisation: failures come back as a device status.

    Nothing is read on the host: the caller reads the status (of many calls at once) when
    it chooses. A failed matrix's results are unspecified (NaN on the CPU).

    Args:
        a: (B, n, n) or (n, n) float32 / float64 symmetric matrices (lower triangle read).

    Returns:
        ``(eigenvalues, eigenvectors, status)``: the first two as :func:`eigh`; ``status``
        int32 ``a.shape[:-2] + (2,)`` on ``a``'s device, per matrix ``[info, non-finite]``:
        the solver's ``info`` (0 on success) and 1 where an eigenvalue or eigenvector is
        not finite. A matrix succeeded when both are 0.

    Raises:
        TypeError: if ``a`` is not float32 or float64.
        ValueError: if ``a`` is not a (batch of) square matrices.
    """
    t = _check_float_tensor(a, "a", (2, 3))
    if t.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"a must be float32 or float64, got {t.dtype}")
    if t.shape[-1] != t.shape[-2]:
        raise ValueError(f"a must hold square matrices, got shape {tuple(t.shape)}")
    if _use_ext("batched_eigh_status", t.device):
        vals, vecs, status = torch.ops.kaisa.batched_eigh_status(t)
        return vals, vecs, status
    return _reference.eigh_status(t)


@_fake("batched_eigh_status")
def _batched_eigh_status_fake(
    a: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _require(a.dim() in (2, 3), lambda: "kaisa batched_eigh: a must be (n, n) or (B, n, n)")
    _require(a.shape[-1] == a.shape[-2], lambda: "kaisa batched_eigh: a must be square")
    status = a.new_empty((*a.shape[:-2], 2), dtype=torch.int32)
    return a.new_empty(a.shape[:-1]), a.new_empty(a.shape), status


def fold(
    running: torch.Tensor, batch: torch.Tensor, stamp: torch.Tensor, skipped: torch.Tensor,
    *, round_: int, decay: float, weight: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Folds one micro-batch factor into a running factor, or skips a non-finite one.

    Where every entry of ``batch`` is finite: ``running * s + batch * weight``, with
    ``s = decay`` unless ``stamp == round_`` (the factor was scaled in this round), and the
    stamp becomes ``round_``; else ``running`` and the stamp stay and ``skipped`` grows by
    one (``docs/conventions.md``, "Folding statistics where they are computed"). No host
    synchronisation: the flags stay on the device. The products and the sum are rounded
    one at a time on every backend. :func:`fold_many` folds several factors in one call.

    Args:
        running: The running factor (any shape, floating point).
        batch: The micro-batch factor, of ``running``'s shape, dtype and device.
        stamp: 0-d int64: the round in which ``running`` was last scaled.
        skipped: 0-d int64: the count of non-finite factors skipped.
        round_: The current fold round.
        decay: ``rho``.
        weight: What ``batch`` is multiplied by.

    Returns:
        New ``(running, stamp, skipped)`` tensors (the inputs are not modified).

    Raises:
        TypeError: If ``running`` is not floating point.
        ValueError: If the shapes, dtypes or devices do not match.
    """
    lists = _check_fold_args([running], [batch], [stamp], [skipped], listed=False)
    (out,), (new_stamp,), (new_skipped,) = _fold_lists(*lists, round_, decay, weight)
    return out, new_stamp, new_skipped


def fold_many(
    running: Sequence[torch.Tensor], batch: Sequence[torch.Tensor],
    stamp: Sequence[torch.Tensor], skipped: Sequence[torch.Tensor],
    *, round_: int, decay: float, weight: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """:func:`fold` of several factors in one operator call (each on its own).

    Tensor ``i`` of the results is :func:`fold` of tensor ``i`` of each list, bit for bit:
    one factor may be skipped (and counted) while another is folded. On CUDA the call is a
    constant number of kernel launches for up to 8 factors (a fill of the flags, one
    finiteness kernel and one update kernel over all of them; two more kernels per 8
    further factors), with no host synchronisation.

    Args:
        running: The running factors (any shapes; floating point, one dtype and device).
        batch: The micro-batch factors, each of its running factor's shape, dtype and
            device.
        stamp: 0-d int64 each: the round in which its running factor was last scaled.
        skipped: 0-d int64 each: the count of non-finite factors skipped.
        round_: The current fold round.
        decay: ``rho``.
        weight: What each batch factor is multiplied by.

    Returns:
        New ``(running, stamp, skipped)`` lists (the inputs are not modified).

    Raises:
        TypeError: If an argument is not a list of tensors or a running factor is not
            floating point.
        ValueError: If the lengths differ, or the shapes, dtypes or devices do not match
            (the message names the index).
    """
    lists = _check_fold_args(running, batch, stamp, skipped)
    return _fold_lists(*lists, round_, decay, weight)


def _fold_lists(
    running: list[torch.Tensor], batch: list[torch.Tensor], stamp: list[torch.Tensor],
    skipped: list[torch.Tensor], round_: int, decay: float, weight: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One ``kaisa::fold`` call for checked lists (the reference for other dtypes)."""
    if not running:
        return [], [], []  # no tensor to dispatch on
    args = (running, batch, stamp, skipped, int(round_), float(decay), float(weight))
    if running[0].dtype in (torch.float32, torch.float64) and _use_ext("fold", running[0].device):
        outs, stamps, counts = torch.ops.kaisa.fold(*args)
        return list(outs), list(stamps), list(counts)
    return _reference.fold_many(*args)


@_fake("fold")
def _fold_fake(running: list[torch.Tensor], batch: list[torch.Tensor],
               stamp: list[torch.Tensor], skipped: list[torch.Tensor], round_: int,
               decay: float, weight: float,
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    _require(len(batch) == len(running) == len(stamp) == len(skipped),
             lambda: "kaisa fold: running, batch, stamp and skipped must be of one length")
    for r, b in zip(running, batch, strict=True):
        _require(b.shape == r.shape, lambda: "kaisa fold: batch must match running")
    return ([torch.empty_like(r, memory_format=torch.contiguous_format) for r in running],
            [torch.empty_like(t) for t in stamp], [torch.empty_like(t) for t in skipped])


OPS: tuple[str, ...] = tuple(_FAKES)
"""Names of the ``torch.ops.kaisa`` operators, each with a wrapper and a fake kernel here."""

_backend._initialise(_FAKES)
