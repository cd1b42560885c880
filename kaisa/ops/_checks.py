"""Argument validation shared by the :mod:`kaisa.ops` functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

_INT32_MAX = 2**31 - 1


class ConvArgs(NamedTuple):
    """The checked arguments that shape a 2D convolution's patches (in the ops' order).

    Attributes:
        kernel_size: ``(kh, kw)``.
        stride: ``(sh, sw)``.
        padding: symmetric zero padding ``(ph, pw)``.
        dilation: ``(dh, dw)``.
        groups: number of convolution groups (divides the input's channels).
    """

    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The output positions ``(out_h, out_w)`` of a ``height x width`` input."""
        oh, ow = (
            (size + 2 * self.padding[i] - self.dilation[i] * (self.kernel_size[i] - 1) - 1)
            // self.stride[i] + 1
            for i, size in enumerate((height, width))
        )
        return oh, ow


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_float_tensor(t: object, name: str, ndims: Sequence[int]) -> torch.Tensor:
    tensor = _check_tensor(t, name)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must have a floating point dtype, got {tensor.dtype}")
    if tensor.dim() not in ndims:
        expected = " or ".join(str(d) for d in ndims)
        raise ValueError(f"{name} must be {expected}-D, got shape {tuple(tensor.shape)}")
    return tensor


def _check_pair(value: object, name: str, minimum: int) -> tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        pair: tuple[object, ...] = (value, value)
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        pair = tuple(value)
    else:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    out: list[int] = []
    for v in pair:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ValueError(f"{name} must contain ints >= {minimum}, got {value!r}")
        out.append(v)
    return out[0], out[1]


def _check_scalar(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _conv_args(
    x: object,
    kernel_size: object,
    stride: object,
    padding: object,
    dilation: object,
    groups: object,
) -> tuple[torch.Tensor, ConvArgs]:
    xt = _check_float_tensor(x, "x", (4,))
    ks = _check_pair(kernel_size, "kernel_size", 1)
    st = _check_pair(stride, "stride", 1)
    pd = _check_pair(padding, "padding", 0)
    dl = _check_pair(dilation, "dilation", 1)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    channels = xt.shape[1]
    if channels % groups != 0:
        raise ValueError(f"groups={groups} must divide the channel count of x ({channels})")
    for dim, name in ((0, "height"), (1, "width")):
        size = xt.shape[2 + dim]
        span = dl[dim] * (ks[dim] - 1) + 1
        if size + 2 * pd[dim] < span:
            raise ValueError(
                f"x {name} {size} with padding {pd[dim]} is smaller than the dilated "
                f"kernel extent {span}"
            )
    return xt, ConvArgs(ks, st, pd, dl, groups)


# --------------------------------------------------------------------------- #
# Ops
# --------------------------------------------------------------------------- #


def _check_eigen_args(
    grad: object,
    qa: object,
    qg: object,
    da: object,
    dg: object,
    dgda: object,
) -> None:
    g = _check_float_tensor(grad, "grad", (2, 3))
    batched = g.dim() == 3
    nd = g.dim()
    a = _check_float_tensor(qa, "qa", (nd,))
    q = _check_float_tensor(qg, "qg", (nd,))
    m, n = g.shape[-2], g.shape[-1]
    lead = (g.shape[0],) if batched else ()
    if m * n > _INT32_MAX or (batched and g.shape[0] > _INT32_MAX):
        raise ValueError(
            "grad must have at most 2^31 - 1 elements per matrix (m * n) and at most 2^31 - 1 "
            f"matrices (the kernels' 32-bit limits), got shape {tuple(g.shape)}"
        )
    if tuple(q.shape) != (*lead, m, m):
        raise ValueError(
            f"qg must have shape {(*lead, m, m)} for grad of shape {tuple(g.shape)}, "
            f"got {tuple(q.shape)}"
        )
    if tuple(a.shape) != (*lead, n, n):
        raise ValueError(
            f"qa must have shape {(*lead, n, n)} for grad of shape {tuple(g.shape)}, "
            f"got {tuple(a.shape)}"
        )
    tensors: list[tuple[str, torch.Tensor]] = [("qa", a), ("qg", q)]
    have_pair = da is not None or dg is not None
    if dgda is not None and have_pair:
        raise ValueError("give either (da, dg) or dgda, not both")
    if dgda is None and not have_pair:
        raise ValueError("one of (da, dg) or dgda must be given")
    if dgda is not None:
        t = _check_float_tensor(dgda, "dgda", (nd,))
        if tuple(t.shape) != tuple(g.shape):
            raise ValueError(
                f"dgda must have the shape of grad {tuple(g.shape)}, got {tuple(t.shape)}"
            )
        tensors.append(("dgda", t))
    else:
        if da is None or dg is None:
            raise ValueError("da and dg must be given together")
        ta = _check_float_tensor(da, "da", (nd - 1,))
        tg = _check_float_tensor(dg, "dg", (nd - 1,))
        if tuple(ta.shape) != (*lead, n):
            raise ValueError(f"da must have shape {(*lead, n)}, got {tuple(ta.shape)}")
        if tuple(tg.shape) != (*lead, m):
            raise ValueError(f"dg must have shape {(*lead, m)}, got {tuple(tg.shape)}")
        tensors += [("da", ta), ("dg", tg)]
    for name, t in tensors:
        if t.dtype != g.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but grad has dtype {g.dtype}")
        if t.device != g.device:
            raise ValueError(f"{name} is on {t.device} but grad is on {g.device}")


def _check_fold_args(
    running: object, batch: object, stamp: object, skipped: object, *, listed: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The contract of :func:`kaisa.ops.fold_many` (``csrc/kaisa.cpp``'s ``check_fold_args``).

    Lists (or tuples) of one length; each running factor floating point, all of one dtype
    and one device; each batch of its running factor's shape, dtype and device; each stamp
    and count a 0-d int64 tensor on that device. A message names the index when
    ``listed`` (``False``: :func:`kaisa.ops.fold`'s single tensors).

    Returns:
        The four lists.
    """
    lists: list[list[torch.Tensor]] = []
    for value, name in ((running, "running"), (batch, "batch"), (stamp, "stamp"),
                        (skipped, "skipped")):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}")
        lists.append([_check_tensor(t, name) for t in value])
    rs, bs, ss, ks = lists
    if not len(rs) == len(bs) == len(ss) == len(ks):
        raise ValueError(f"running, batch, stamp and skipped must be lists of one length, got "
                         f"{len(rs)}, {len(bs)}, {len(ss)} and {len(ks)}")
    for i, (r, b, st, sk) in enumerate(zip(rs, bs, ss, ks, strict=True)):
        at = f" at index {i}" if listed else ""
        if not r.is_floating_point():
            raise TypeError(f"running must have a floating point dtype{at}, got {r.dtype}")
        if r.dtype != rs[0].dtype or r.device != rs[0].device:
            raise ValueError(f"running must have one dtype and one device: {rs[0].dtype} on "
                             f"{rs[0].device} at index 0, {r.dtype} on {r.device}{at}")
        if b.dtype != r.dtype or b.shape != r.shape or b.device != r.device:
            raise ValueError(f"batch must have running's shape, dtype and device "
                             f"{tuple(r.shape)}, {r.dtype}, {r.device}{at}; got "
                             f"{tuple(b.shape)}, {b.dtype}, {b.device}")
        for c, name in ((st, "stamp"), (sk, "skipped")):
            if c.dim() != 0 or c.dtype != torch.int64 or c.device != r.device:
                raise ValueError(f"{name} must be a 0-d int64 tensor on {r.device}{at}, got "
                                 f"{c.dtype} of shape {tuple(c.shape)} on {c.device}")
    return rs, bs, ss, ks
