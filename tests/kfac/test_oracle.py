"""kaisa.KFAC's G sources against curvlinops and explicit math: 'mc', 'type2', 'empirical'.

docs/conventions.md ("Where kaisa.KFAC's G comes from", and the relation to curvlinops'
KFACLinearOperator) has the definitions and the scalars these tests check.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from tests.support.sequence import C, N, Sequence, T, sequence_data

pytestmark = pytest.mark.usefixtures("float64")

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _kfac(model: nn.Module, loss: str, curvature: str, **kw: Any) -> kaisa.KFAC:
    # a fixed lr is Fisher-scaled with 'mc' and 'type2'; 'empirical' is with the adaptive lr
    mode: dict[str, Any] = ({"lr": "adaptive"} if curvature == "empirical"
                            else {"lr": 0.1, "momentum": 0.0})
    return kaisa.KFAC(model, loss=loss, curvature=curvature, factor_decay=1e-300,
                      inv_dtype=torch.float64, **mode, **kw)


def _recording_draws(opt: kaisa.KFAC) -> list[torch.Tensor]:
    """The targets ``opt`` draws, in order."""
    drawn: list[torch.Tensor] = []
    sample = opt.loss.sample_targets

    def recorded(outputs: torch.Tensor, *rest: Any) -> torch.Tensor:
        drawn.append(sample(outputs, *rest))
        return drawn[-1]

    opt.loss.sample_targets = recorded  # type: ignore[method-assign]
    return drawn


def _kfac_factors(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: str, curvature: str, **kw: Any
) -> tuple[Factors, list[torch.Tensor]]:
    """A and G after one step of ``kaisa.KFAC`` (factor decay ~0: the batch's), the draws."""
    opt = _kfac(model, loss, curvature, **kw)
    drawn = _recording_draws(opt)
    opt.step(lambda: (model(x), y))
    out: Factors = {}
    for name, block in opt.curvature.blocks.items():
        assert block.a_factor is not None and block.g_factor is not None
        out[name] = (block.a_factor, block.g_factor)
    return out, drawn


# --------------------------------------------------------------------------- curvlinops


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("curvature", ["type2", "mc", "empirical"])
@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_fisher_scaled_factors_equal_curvlinops_up_to_the_documented_scalars(
    approx: str, curvature: str, loss: str, reduction: str
) -> None:
    curvlinops = pytest.importorskip("curvlinops")
    torch.manual_seed(0)
    model = Sequence()
    reference = copy.deepcopy(model)  # the parameters before the step
    x, y = sequence_data(loss)
    seed, samples = 3, (3 if curvature == "mc" else 1)
    got, drawn = _kfac_factors(model, x, y, loss, curvature, reduction=reduction,
                               kfac_approx=approx, mc_samples=samples, seed=seed)
    their_draws: list[torch.Tensor] = []

    class Recording(curvlinops.KFACLinearOperator):  # type: ignore[misc, name-defined]
        def draw_label(self, output: torch.Tensor) -> torch.Tensor:
            their_draws.append(super().draw_label(output))
            return their_draws[-1]

    fisher_type = {"type2": curvlinops.FisherType.TYPE2, "mc": curvlinops.FisherType.MC,
                   "empirical": curvlinops.FisherType.EMPIRICAL}[curvature]
    loss_fn = nn.CrossEntropyLoss(reduction=reduction) if loss == "cross_entropy" else (
        nn.MSELoss(reduction=reduction))
    op = Recording(
        reference, loss_fn, list(reference.parameters()), [(x, y)], fisher_type=fisher_type,
        mc_samples=samples, seed=seed, kfac_approx=approx, separate_weight_and_bias=False,
        check_deterministic=False,
    )
    op.compute_kronecker_factors()
    # the same seed draws the same targets (asserted): the Monte-Carlo G compare exactly
    assert len(drawn) == len(their_draws) == (samples if curvature == "mc" else 0)
    for ours, theirs in zip(drawn, their_draws, strict=True):
        assert torch.equal(ours, theirs)
    # docs/conventions.md: A is the same; curvlinops' G is kaisa's Fisher-scaled G with
    # 'expand' and 1/T times it with 'reduce' (N examples of T terms, either reduction)
    scale = 1.0 if approx == "expand" else 1.0 / T
    for name in ("first", "last"):
        a, g = got[name]
        torch.testing.assert_close(op._input_covariances[name], a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(op._gradient_covariances[name], scale * g,
                                   rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- expectation


def _layer_gradients(
    model: Sequence, x: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], dict[str, torch.Tensor]]]:
    """The outputs, and ``u -> {layer: its output's gradient}`` for output gradient ``u``."""
    hidden = model.first(x)
    logits = model.last(torch.tanh(hidden))

    def backprop(u: torch.Tensor) -> dict[str, torch.Tensor]:
        d_first, d_last = torch.autograd.grad(logits, (hidden, logits), u.reshape(N, T, C),
                                              retain_graph=True)
        return {"first": d_first, "last": d_last}

    return logits.reshape(-1, C), backprop


def _rule(d: torch.Tensor, approx: str, divisor: float) -> torch.Tensor:
    """The per-batch G of one pass (docs/conventions.md), ``D`` divided by ``divisor``."""
    d = d / divisor
    if approx == "expand":
        rows = d.reshape(-1, d.shape[-1])
        return rows.T @ rows / rows.shape[0]
    sums = d.sum(1)
    return sums.T @ sums / sums.shape[0]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_type2_is_the_exact_expectation_of_mc_where_rows_hold_one_position(approx: str) -> None:
    torch.manual_seed(0)
    model = Sequence()
    x, y = sequence_data()
    got, _ = _kfac_factors(copy.deepcopy(model), x, y, "cross_entropy", "type2",
                           kfac_approx=approx)
    outputs, backprop = _layer_gradients(model, x)
    p = torch.softmax(outputs.detach(), dim=-1)  # (N*T, C)
    c = 1.0 / (N * T)  # mean over the N*T positions; n = N*T terms
    divisor = math.sqrt(c / (N * T))
    expectation = {name: torch.zeros(h, h) for name, h in (("first", 7), ("last", C))}
    for i in range(N * T):  # E[G(u)] of 'mc': one position's draw at a time, by enumeration
        for cls in range(C):
            u = torch.zeros(N * T, C)
            u[i] = c * (p[i] - F.one_hot(torch.tensor(cls), C))  # grad of c * l_i at y = cls
            for name, d in backprop(u).items():
                expectation[name] += p[i, cls] * _rule(d, approx, divisor)
    # 'type2': column k of every position's S_i = diag(sqrt p_i) - p_i sqrt(p_i)^T at once
    root = p.sqrt()
    crossed = {name: torch.zeros_like(e) for name, e in expectation.items()}
    for k in range(C):
        u = c * (torch.diag_embed(root) - p[:, :, None] * root[:, None, :])[:, :, k]
        for name, d in backprop(u).items():
            crossed[name] += _rule(d, approx, divisor)
    for name in ("first", "last"):
        torch.testing.assert_close(got[name][1], crossed[name], rtol=1e-10, atol=1e-14)
        if approx == "expand":  # every row one position: exactly the expectation
            torch.testing.assert_close(got[name][1], expectation[name], rtol=1e-10, atol=1e-14)
        else:  # 'reduce' sums an example's positions: type2 adds their pairs i != j
            assert not torch.allclose(got[name][1], expectation[name], rtol=1e-3)


# --------------------------------------------------------------------------- one layer


class _OneLayer(nn.Module):
    """One Linear layer, then a fixed map: ``f = tanh(W x + b) P^T``."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 5)
        self.register_buffer("proj", torch.randn(classes, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x)) @ self.proj.T


def _one_layer(classes: int = C) -> tuple[_OneLayer, torch.Tensor]:
    torch.manual_seed(0)
    return _OneLayer(classes), torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_type2_of_one_layer_is_the_explicit_sum_over_columns(loss: str, reduction: str) -> None:
    model, x = _one_layer()
    rows = x.shape[0]
    y = torch.arange(rows) % C if loss == "cross_entropy" else torch.randn(rows, C)
    got, _ = _kfac_factors(copy.deepcopy(model), x, y, loss, "type2", reduction=reduction)
    a, g = got["layer"]
    xb = torch.cat([x, torch.ones(rows, 1)], dim=1)
    torch.testing.assert_close(a, xb.T @ xb / rows, rtol=1e-12, atol=1e-14)
    # J^T s = (1 - tanh(z)^2) * (s P): the layer output's gradient for output gradient s
    z = model.layer(x).detach()
    slope, proj = 1 - torch.tanh(z) ** 2, model.proj
    if loss == "cross_entropy":
        p = torch.softmax(torch.tanh(z) @ proj.T, dim=-1)
        roots = [torch.diag(p[r].sqrt()) - torch.outer(p[r], p[r].sqrt()) for r in range(rows)]
        c = 1.0 / rows if reduction == "mean" else 1.0
    else:
        roots = [math.sqrt(2.0) * torch.eye(C)] * rows
        c = 1.0 / (rows * C) if reduction == "mean" else 1.0
    n = rows  # the terms: positions (cross-entropy), rows (squared error)
    expected = torch.zeros(5, 5)
    for r in range(rows):  # mean over rows of the sum over columns, D = J^T (c S) / sqrt(c/n)
        for k in range(C):
            d = slope[r] * ((c * roots[r][:, k]) @ proj) / math.sqrt(c / n)
            expected += torch.outer(d, d) / rows
    torch.testing.assert_close(g, expected, rtol=1e-10, atol=1e-14)


def test_mc_of_one_layer_is_the_explicit_mean_over_kaisas_draws() -> None:
    model, x = _one_layer()
    rows, samples = x.shape[0], 4
    got, drawn = _kfac_factors(copy.deepcopy(model), x, torch.arange(rows) % C,
                               "cross_entropy", "mc", mc_samples=samples, seed=5)
    assert len(drawn) == samples
    z = model.layer(x).detach()
    p = torch.softmax(torch.tanh(z) @ model.proj.T, dim=-1)
    c = 1.0 / rows
    expected = torch.zeros(5, 5)
    for targets in drawn:  # u = grad of c sum_i l_i at the drawn targets = c (p - onehot)
        u = c * (p - F.one_hot(targets, C))
        d = (1 - torch.tanh(z) ** 2) * (u @ model.proj) / math.sqrt(c / rows)
        expected += d.T @ d / rows / samples
    torch.testing.assert_close(got["layer"][1], expected, rtol=1e-10, atol=1e-14)


# --------------------------------------------------------------------------- training


def _classifier() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()  # three classes
    return model, x, y


@pytest.mark.parametrize("mode", [
    {}, {"jvp": "double_backward"}, {"lr": 0.2, "momentum": 0.9},
])
def test_type2_trains_a_small_classifier(mode: dict[str, Any]) -> None:
    model, x, y = _classifier()
    opt = kaisa.KFAC(model, loss="cross_entropy", curvature="type2", **mode)
    with torch.no_grad():
        losses = [float(F.cross_entropy(model(x), y))]
    for _ in range(15):
        loss = opt.step(lambda: (model(x), y))
        assert loss is not None and torch.isfinite(loss)
    with torch.no_grad():
        losses.append(float(F.cross_entropy(model(x), y)))
    assert losses[1] < 0.5 * losses[0], losses


def test_type2_double_backward_records_the_same_g_as_forward_mode() -> None:
    # with jvp='double_backward' the first column's pass also builds J^T
    factors = []
    for jvp in ("forward", "double_backward"):
        model, x, y = _classifier()
        got, _ = _kfac_factors(model, x, y, "cross_entropy", "type2", jvp=jvp)
        factors.append(got)
    for name, (a, g) in factors[0].items():
        torch.testing.assert_close(factors[1][name][0], a, rtol=0, atol=0)
        torch.testing.assert_close(factors[1][name][1], g, rtol=1e-13, atol=1e-16)


def test_type2_factors_computed_in_step_equal_the_hooks() -> None:
    # update_factors_in_hook=False keeps each pass's output gradient with its divisor
    factors = []
    for in_hook in (True, False):
        model, x, y = _classifier()
        got, _ = _kfac_factors(model, x, y, "cross_entropy", "type2",
                               update_factors_in_hook=in_hook)
        factors.append(got)
    for name, (a, g) in factors[0].items():
        torch.testing.assert_close(factors[1][name][0], a, rtol=1e-14, atol=0)
        torch.testing.assert_close(factors[1][name][1], g, rtol=1e-13, atol=1e-16)


def test_type2_with_a_power_of_two_loss_scale_changes_nothing() -> None:
    models = [_classifier()[0], _classifier()[0]]
    _, x, y = _classifier()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1_000_000)
    opts = [kaisa.KFAC(m, loss="cross_entropy", curvature="type2", grad_scaler=s)
            for m, s in zip(models, (None, scaler), strict=True)]
    for _ in range(3):
        for m, opt in zip(models, opts, strict=True):
            opt.step(lambda m=m: (m(x), y))
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- bad inputs


def test_type2_above_its_column_limit_raises_and_records_nothing() -> None:
    from kaisa.kfac.config import TYPE2_MAX_COLUMNS

    classes = TYPE2_MAX_COLUMNS + 1
    model, x = _one_layer(classes)
    opt = kaisa.KFAC(model, loss="cross_entropy", curvature="type2")
    y = torch.arange(x.shape[0]) % classes
    with pytest.raises(ValueError, match=rf"curvature='type2'.*\(8, {classes}\) need "
                                         rf"{classes}, more than {TYPE2_MAX_COLUMNS}"):
        opt.step(lambda: (model(x), y))
    assert not any(b.stats.has_factors for b in opt.curvature.blocks.values())
    assert opt.steps == 0
    fits, _ = _one_layer(TYPE2_MAX_COLUMNS)  # the limit itself runs
    ok = kaisa.KFAC(fits, loss="cross_entropy", curvature="type2", lr=0.1, momentum=0.0)
    assert ok.step(lambda: (fits(x), torch.arange(x.shape[0]))) is not None


def test_type2_needs_a_closure_and_a_valid_name() -> None:
    model, x, y = _classifier()
    opt = kaisa.KFAC(model, loss="cross_entropy", curvature="type2", lr=0.1, momentum=0.0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"needs a closure.*'type2'"):
        opt.step()
    with pytest.raises(ValueError, match=r"curvature='type-3' is not valid.*'type2'"):
        kaisa.KFAC(model, loss="cross_entropy", curvature="type-3")
