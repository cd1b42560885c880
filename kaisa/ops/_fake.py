"""Fake (meta) kernels of the ``torch.ops.kaisa`` operators.

They describe output shapes, dtypes and strides so the ops work under
``torch.compile``/FakeTensor tracing. Imported by :mod:`kaisa.ops` right after
``kaisa._C`` loads (the op schemas must exist before registering). The output
contract is documented in ``csrc/SCHEMAS.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__: list[str] = []


def _covariance_fake(x: torch.Tensor, scale: float, bias: bool) -> torch.Tensor:
    if x.dim() != 2:
        raise RuntimeError(f"kaisa covariance: x must be 2-D, got {x.dim()}-D")
    d = x.shape[1] + int(bias)
    return x.new_empty((d, d))


def _conv_dim(x: torch.Tensor, kernel_size: Sequence[int], groups: int, bias: bool) -> int:
    if x.dim() != 4:
        raise RuntimeError(f"kaisa conv_covariance: x must be 4-D, got {x.dim()}-D")
    return x.shape[1] // groups * kernel_size[0] * kernel_size[1] + int(bias)


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
    d = _conv_dim(x, kernel_size, groups, bias)
    return x.new_empty((groups, d, d))


def _covariance_ema_fake(
    running: torch.Tensor, x: torch.Tensor, scale: float, bias: bool, rho: float
) -> None:
    return None


def _conv_covariance_ema_fake(
    running: torch.Tensor,
    x: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    groups: int,
    bias: bool,
    scale: float,
    rho: float,
) -> None:
    return None


def _eigen_precondition_fake(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    da: torch.Tensor | None,
    dg: torch.Tensor | None,
    dgda: torch.Tensor | None,
    damping: float,
) -> torch.Tensor:
    return grad.new_empty(grad.shape)


def _batched_eigh_fake(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dim() < 2:
        raise RuntimeError("kaisa batched_eigh: a must be at least 2-D")
    return a.new_empty(a.shape[:-1]), a.new_empty(a.shape)


_FAKES: dict[str, Callable[..., object]] = {
    "kaisa::covariance": _covariance_fake,
    "kaisa::conv_covariance": _conv_covariance_fake,
    "kaisa::covariance_ema_": _covariance_ema_fake,
    "kaisa::conv_covariance_ema_": _conv_covariance_ema_fake,
    "kaisa::eigen_precondition": _eigen_precondition_fake,
    "kaisa::batched_eigh": _batched_eigh_fake,
}

for _name, _fn in _FAKES.items():
    torch.library.register_fake(_name, _fn)
