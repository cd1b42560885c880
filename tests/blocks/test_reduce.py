"""KFAC-expand and KFAC-reduce on sequences: explicit math, and curvlinops as an oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from tests.support.sequence import C, N, Sequence, T, sequence_data

pytestmark = pytest.mark.usefixtures("float64")


def _batch_factors(approx: str) -> tuple[nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """kaisa's A and G of one empirical-Fisher step (factor decay ~0: the batch's)."""
    torch.manual_seed(0)
    model = Sequence()
    pre = kaisa.KFACPreconditioner(model, kfac_approx=approx, factor_decay=1e-300)
    x, y = sequence_data()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    out = {}
    for name, layer in pre.layers.items():
        assert layer.a_factor is not None and layer.g_factor is not None
        out[name] = (layer.a_factor, layer.g_factor)
    return model, out


def test_reduce_factors_are_the_explicit_means_and_sums() -> None:
    model, got = _batch_factors("reduce")
    x, y = sequence_data()
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for name in ("first", "last"):
        module = getattr(model, name)
        def hook(m: nn.Module, a: tuple[torch.Tensor], o: torch.Tensor, n: str = name) -> None:
            inputs[n] = a[0]
            o.register_hook(lambda d, n=n: grads.__setitem__(n, d))  # type: ignore[misc]

        module.register_forward_hook(hook)
    F.cross_entropy(model(x), y).backward()
    for name in ("first", "last"):
        xbar = torch.cat([inputs[name].mean(1), torch.ones(N, 1)], dim=1)
        dsum = grads[name].sum(1)
        torch.testing.assert_close(got[name][0], xbar.T @ xbar / N, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[name][1], dsum.T @ dsum / N, rtol=1e-12, atol=1e-12)
    _, expanded = _batch_factors("expand")
    assert not torch.allclose(expanded["first"][0], got["first"][0])  # they differ on sequences


def test_reduce_equals_expand_without_shared_dimensions() -> None:
    def factors(approx: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, C))
        pre = kaisa.KFACPreconditioner(model, kfac_approx=approx)
        x = torch.randn(N, 6, generator=torch.Generator().manual_seed(1))
        F.cross_entropy(model(x), torch.arange(N) % C).backward()
        pre.step()
        return [t for la in pre.layers.values() for t in (la.a, la.g) if t is not None]

    for a, b in zip(factors("reduce"), factors("expand"), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="kfac_approx"):
        kaisa.KFACPreconditioner(nn.Linear(2, 2), kfac_approx="average")


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_linear_factors_equal_curvlinops_up_to_the_documented_scalars(approx: str) -> None:
    curvlinops = pytest.importorskip("curvlinops")
    model, got = _batch_factors(approx)
    x, y = sequence_data()
    params = [p for p in model.parameters()]
    op = curvlinops.KFACLinearOperator(
        model, nn.CrossEntropyLoss(), params, [(x, y)],
        fisher_type=curvlinops.FisherType.EMPIRICAL, kfac_approx=approx,
        separate_weight_and_bias=False, check_deterministic=False,
    )
    op.compute_kronecker_factors()
    # docs/conventions.md: A is the same; for a mean-reduced loss over N examples of T
    # terms, curvlinops' G is (N T)^2 kaisa's with 'expand' and N^2 T kaisa's with 'reduce'
    scale = (N * T) ** 2 if approx == "expand" else N * N * T
    for name in ("first", "last"):
        a, g = got[name]
        torch.testing.assert_close(op._input_covariances[name], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(op._gradient_covariances[name], scale * g,
                                   rtol=1e-10, atol=1e-12)
