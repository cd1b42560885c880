"""Explicit (independent) K-FAC math used by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def same_padding(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    """(left, right, top, bottom) torch uses for padding='same' (extra pixel right/bottom)."""
    (kh, kw), (dh, dw) = conv.kernel_size, conv.dilation
    th, tw = dh * (kh - 1), dw * (kw - 1)
    return tw // 2, tw - tw // 2, th // 2, th - th // 2


def explicit_pad(conv: nn.Conv2d) -> tuple[int, int, int, int]:
    if conv.padding == "same":
        return same_padding(conv)
    if conv.padding == "valid":
        return 0, 0, 0, 0
    ph, pw = conv.padding  # type: ignore[misc]
    return pw, pw, ph, ph


def conv_patches(conv: nn.Conv2d, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """im2col rows (N*S, C*kh*kw) and S, built with F.unfold on an explicitly padded input."""
    xp = F.pad(x, explicit_pad(conv))
    cols = F.unfold(xp, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    n, d, s = cols.shape
    return cols.transpose(1, 2).reshape(n * s, d), s


def conv_a_batch(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(groups, d, d) A factors, each (Pb/S)^T (Pb/S) / (N*S)."""
    p, s = conv_patches(conv, x)
    g = conv.groups
    per = p.shape[1] // g
    out = []
    for k in range(g):
        pk = p[:, k * per:(k + 1) * per]
        if conv.bias is not None:
            pk = torch.cat([pk, torch.ones(pk.shape[0], 1, dtype=pk.dtype)], 1)
        pk = pk / s
        out.append(pk.T @ pk / pk.shape[0])
    return torch.stack(out)


def conv_g_batch(conv: nn.Conv2d, dout: torch.Tensor) -> torch.Tensor:
    n, c, oh, ow = dout.shape
    s = oh * ow
    d = dout.permute(0, 2, 3, 1).reshape(n * s, c) / s
    m = c // conv.groups
    return torch.stack(
        [d[:, k * m:(k + 1) * m].T @ d[:, k * m:(k + 1) * m] / (n * s) for k in range(conv.groups)]
    )


def linear_a_batch(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if lin.bias is not None:
        x2 = torch.cat([x2, torch.ones(x2.shape[0], 1, dtype=x2.dtype)], 1)
    return (x2.T @ x2 / x2.shape[0]).unsqueeze(0)


def rows_a(x: torch.Tensor, *, bias: bool) -> torch.Tensor:
    """``Xb^T Xb / M`` of the rows of ``x`` (all leading dimensions), ``(n, n)``."""
    x2 = x.reshape(-1, x.shape[-1])
    if bias:
        x2 = torch.cat([x2, torch.ones(x2.shape[0], 1, dtype=x2.dtype)], 1)
    return x2.T @ x2 / x2.shape[0]


def linear_g_batch(dout: torch.Tensor) -> torch.Tensor:
    d = dout.reshape(-1, dout.shape[-1])
    return (d.T @ d / d.shape[0]).unsqueeze(0)


def grad_blocks(module: nn.Module) -> torch.Tensor:
    """[W.grad | b.grad] as (groups, out/groups, n)."""
    w = module.weight.grad
    out = w.shape[0]
    mat = w.reshape(out, -1)
    if module.bias is not None:
        mat = torch.cat([mat, module.bias.grad.reshape(out, 1)], 1)
    groups = getattr(module, "groups", 1)
    return mat.reshape(groups, out // groups, -1)


def kron_solve(g: torch.Tensor, a: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """vec(out) = (G kron A + damping I)^-1 vec(grad) (row-major vec)."""
    k = torch.kron(g, a)
    k = k + damping * torch.eye(k.shape[0], dtype=k.dtype)
    return torch.linalg.solve(k, grad.reshape(-1)).reshape(grad.shape)


def one_step_grads(layer: nn.Module, x: torch.Tensor, r: torch.Tensor) -> None:
    """Backward of loss = sum(layer(x) * r), so the output gradient is exactly r."""
    (layer(x) * r).sum().backward()
