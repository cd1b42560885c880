"""Loss-scale edge cases and finiteness checks that cannot overflow."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import kaisa
from kaisa.blocks import RunningFactors


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _step(pre: kaisa.KFACPreconditioner, model: nn.Module, loss_scale: float = 1.0) -> None:
    model.zero_grad()
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    (model(x).square().sum() * loss_scale).backward()
    pre.step()


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize(
    "scale", [math.nan, math.inf, 0.0, -4.0], ids=["nan", "inf", "zero", "negative"]
)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_invalid_loss_scale_skips_g_factors_and_counts_them(
    backend: str, scale: float, as_tensor: bool
) -> None:
    if backend == "ext" and not kaisa.ops.extension_available():
        pytest.skip("no extension")
    model = _model()
    value = torch.tensor(scale) if as_tensor else scale
    with kaisa.ops.use_backend(backend):
        pre = kaisa.KFACPreconditioner(model, grad_scaler=lambda: value)
        _step(pre, model)
    assert pre.skipped_factor_updates == 2  # one G per layer, A factors are fine
    for layer in pre.layers.values():
        assert layer.g is not None
        assert torch.equal(layer.g, torch.eye(layer.g.shape[-1]).unsqueeze(0))  # not folded
        assert layer.a is not None and torch.isfinite(layer.a).all()


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_extreme_loss_scales_unscale_without_overflow(scale: float) -> None:
    reference, scaled = _model(), _model()
    pre_ref = kaisa.KFACPreconditioner(reference, inv_dtype=torch.float64)
    pre = kaisa.KFACPreconditioner(scaled, grad_scaler=lambda: scale, inv_dtype=torch.float64)
    _step(pre_ref, reference)
    _step(pre, scaled, loss_scale=scale)  # gradients scaled like a GradScaler would
    assert pre.skipped_factor_updates == 0
    for name, layer in pre.layers.items():
        want = pre_ref.layers[name].g
        assert layer.g is not None and want is not None
        torch.testing.assert_close(layer.g, want, rtol=1e-4, atol=1e-6)


def test_finite_factor_near_float32_max_is_folded() -> None:
    f = RunningFactors()
    big = torch.full((1, 3, 3), 3e38)  # finite; its sum overflows float32
    f.fold(big, None, 0.5)
    assert f.skipped == 0 and f.a is not None and torch.isfinite(f.a).all()


def test_finite_preconditioned_gradient_with_huge_entries_is_written() -> None:
    from kaisa.blocks import Preconditioned
    from kaisa.clipping import write_preconditioned

    model = nn.Linear(3, 2, bias=False)
    pre = kaisa.KFACPreconditioner(model, kl_clip=None)
    layer = pre.layers[""]
    model.weight.grad = torch.ones_like(model.weight)
    grad = layer.gradient_matrix()
    assert grad is not None
    huge = torch.full_like(grad, 2e38)  # finite, sum overflows float32
    write_preconditioned([Preconditioned(layer, grad, huge)], kl_clip=None, lr=0.1)
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 2e38))


def test_large_factor_warning_names_layer_size_cost_and_fix() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(8192, 4), nn.Linear(4, 2))
    with pytest.warns(RuntimeWarning) as caught:
        pre = kaisa.KFACPreconditioner(model)
    messages = [str(w.message) for w in caught if "factor" in str(w.message)]
    assert len(messages) == 1, messages
    msg = messages[0]
    assert "'1'" in msg and "8193x8193 A factor" in msg and "MB" in msg and "GFLOP" in msg
    assert "skip_layers=['^1$']" in msg
    assert pre.factor_sizes()[0].dim == 8193
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing above the threshold: no warning
        kaisa.KFACPreconditioner(nn.Sequential(nn.Linear(8191, 4)))
