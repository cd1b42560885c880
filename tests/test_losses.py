"""kaisa.losses: the targets' shape rules (docs/reliability.md), the type-2 factors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.losses import Loss

pytestmark = pytest.mark.usefixtures("float64")


def test_mse_targets_of_another_shape_name_both_shapes() -> None:
    loss = Loss.of("mse")
    with pytest.raises(ValueError, match=r"targets of shape \(8, 4\).*outputs of shape \(4, 8\)"):
        loss(torch.randn(4, 8), torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"\(4,\).*\(4, 1\)"):  # no (4, 4) broadcast either
        loss(torch.randn(4, 1), torch.randn(4))
    model = nn.Linear(3, 8)
    opt = kaisa.KFAC(model, loss="mse")
    with pytest.raises(ValueError, match=r"\(8, 4\).*\(4, 8\)"):
        opt.step(lambda: (model(torch.randn(4, 3)), torch.randn(8, 4)))


def test_sequence_cross_entropy_takes_class_logits_last_and_names_both_shapes() -> None:
    loss = Loss.of("cross_entropy")
    logits = torch.randn(2, 3, 5)  # (B, T, C)
    targets = torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(loss(logits, targets),
                               F.cross_entropy(logits.permute(0, 2, 1), targets))
    with pytest.raises(ValueError, match=r"targets of shape \(3, 2\).*outputs of shape "
                                         r"\(2, 3, 5\).*must have shape \(2, 3\)"):
        loss(logits, targets.T)  # (T, B): today silently reshaped


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 4), (1, 2)])
def test_cross_entropy_fisher_sqrt_squares_to_the_sampled_gradients_covariance(
    shape: tuple[int, ...], reduction: str
) -> None:
    loss = Loss.of("cross_entropy", reduction)
    f = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    columns = loss.fisher_sqrt(f)
    classes, positions = shape[-1], f.numel() // shape[-1]
    assert columns.shape == (classes, *shape) and columns.dtype == f.dtype
    c = 1.0 / positions if reduction == "mean" else 1.0
    p = torch.softmax(f.reshape(-1, classes), dim=-1)
    flat = columns.reshape(classes, positions, classes)
    for i in range(positions):
        # E over y ~ p_i of g g^T, g = grad of c * l_i = c (p_i - onehot(y)): enumerated
        expected = sum(p[i, y] * torch.outer(c * (p[i] - F.one_hot(torch.tensor(y), classes)),
                                             c * (p[i] - F.one_hot(torch.tensor(y), classes)))
                       for y in range(classes))
        torch.testing.assert_close(flat[:, i].T @ flat[:, i], expected, rtol=1e-12, atol=1e-15)
        # curvlinops' factor: column k is c (sqrt(p_k) e_k - p sqrt(p_k))
        for k in range(classes):
            e_k = F.one_hot(torch.tensor(k), classes)
            column = c * (p[i, k].sqrt() * e_k - p[i] * p[i, k].sqrt())
            torch.testing.assert_close(flat[k, i], column, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 2), (5,)])
def test_mse_fisher_sqrt_is_c_sqrt2_identity_columns(
    shape: tuple[int, ...], reduction: str
) -> None:
    loss = Loss.of("mse", reduction)
    f = torch.randn(*shape)
    columns = loss.fisher_sqrt(f)
    c = 1.0 / f.numel() if reduction == "mean" else 1.0
    # the gradient of c (f - y)^2 at y ~ f + N(0, 1/2) has covariance 2 c^2 I (elementwise)
    if len(shape) == 1:
        assert columns.shape == (1, *shape)
        torch.testing.assert_close(columns[0], torch.full(shape, c * 2**0.5))
        return
    k = shape[-1]
    assert columns.shape == (k, *shape)
    for j in range(k):
        expected = torch.zeros(shape)
        expected[..., j] = c * 2**0.5
        torch.testing.assert_close(columns[j], expected, rtol=1e-15, atol=0)
