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
    from kaisa.core.clipping import write_preconditioned

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


@pytest.mark.parametrize("backend", ["ext", "torch"])
@pytest.mark.parametrize("bias", [True, False])
def test_finite_factor_whose_float32_sum_overflows_is_folded(backend: str, bias: bool) -> None:
    """Inputs of 1.2e19: every A entry is 1.44e38 (finite), X^T X before its 1/M is not.

    The factors are computed with the inputs pre-scaled when the unscaled sum could
    overflow, on every backend, so they are folded in (before: skipped as non-finite).
    """
    if backend == "ext" and not kaisa.ops.extension_available():
        pytest.skip("extension not built")
    from kaisa.blocks import factors

    geometry = factors.ConvGeometry((3, 3), (1, 1), (1, 1), 1, (1, 1, 1, 1))
    grouped = factors.ConvGeometry((1, 1), (1, 1), (1, 1), 2, (0, 0, 0, 0))
    v = 1.2e19
    with kaisa.ops.use_backend(backend):
        a_lin = factors.linear_a_factor(torch.full((8, 3), v), bias=bias, dtype=torch.float32)
        g_lin = factors.linear_g_factor(torch.full((8, 4), v), dtype=torch.float32)
        a_conv = factors.conv_a_factor(
            torch.full((2, 2, 4, 4), v), geometry, bias=bias, dtype=torch.float32
        )
        a_grouped = factors.conv_a_factor(
            torch.full((2, 4, 4, 4), v), grouped, bias=bias, dtype=torch.float32
        )
        g_conv = factors.conv_g_factor(torch.full((2, 3, 4, 4), v), groups=1, dtype=torch.float32)
        g_grouped = factors.conv_g_factor(
            torch.full((2, 4, 4, 4), v), groups=2, dtype=torch.float32
        )
        a_lin64 = factors.linear_a_factor(torch.full((8, 3), v), bias=bias, dtype=torch.float64)
    # Linear: v^2 everywhere, v in the bias row and column, 1 in the corner.
    torch.testing.assert_close(a_lin, a_lin64.float(), rtol=1e-6, atol=0.0)
    assert a_lin[0, 0, 0].item() == pytest.approx(1.44e38, rel=1e-6)
    if bias:
        assert a_lin[0, 0, -1].item() == pytest.approx(v, rel=1e-6)
        assert a_lin[0, -1, -1].item() == pytest.approx(1.0, rel=1e-6)
    for name, factor in {"A linear": a_lin, "G linear": g_lin, "A conv": a_conv,
                         "A grouped conv": a_grouped, "G conv": g_conv,
                         "G grouped conv": g_grouped}.items():
        assert bool(torch.isfinite(factor).all()), name
        assert torch.equal(factor, factor.transpose(-1, -2)), name
        running = RunningFactors()
        running.fold(factor, factor, 0.95)
        assert running.skipped == 0 and running.a is not None, name
    # G of a Conv2d: (D/S)^T (D/S) / (N*S) = v^2 / S^2 with S = 16 positions.
    assert g_conv[0, 0, 0].item() == pytest.approx(1.44e38 / 256, rel=1e-6)
    assert g_grouped[0, 0, 0].item() == pytest.approx(1.44e38 / 256, rel=1e-6)


def test_finite_factor_whose_sum_overflows_is_folded_by_the_preconditioner() -> None:
    model = nn.Linear(3, 2)
    pre = kaisa.KFACPreconditioner(model, kl_clip=None)
    with torch.no_grad():
        model.weight.zero_()
    model(torch.full((8, 3), 1.2e19)).sum().backward()
    pre.step()
    layer = pre.layers[""]
    assert pre.skipped_factor_updates == 0
    assert layer.a is not None and bool(torch.isfinite(layer.a).all())


def test_prescaled_passes_a_safe_cpu_input_on_uncopied() -> None:
    x = torch.randn(64, 5)
    out, f = kaisa.ops.prescaled(x, 64, 1.0 / 64)
    assert out is x and f == 1.0  # no x * 1 pass on the CPU, and no call after aminmax
    assert kaisa.ops.rescaled(out, f, bias=True) is out
    big = torch.full((64, 5), 1e19)  # 64 * 1e38 overflows float32 before the 1 / 64
    out, f = kaisa.ops.prescaled(big, 64, 1.0 / 64)
    assert out is not big and float(f) == pytest.approx(0.125)
    assert torch.equal(out, big * f)
