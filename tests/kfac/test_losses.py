"""kaisa.kfac.losses: the targets' shape rules (docs/reliability.md), the type-2 factors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.kfac.losses import Loss

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
# --------------------------------------------------------------------------- sampled targets


def _gen(seed: int = 3) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_one_process_samples_classes_as_torch_multinomial_does() -> None:
    logits = torch.randn(4, 5, 7)  # (B, T, C)
    g_ours, g_ref = _gen(), _gen()
    drawn = Loss.of("cross_entropy").sample_targets(logits, g_ours)
    probs = torch.softmax(logits.reshape(-1, 7).float(), dim=-1)
    want = torch.multinomial(probs, 1, generator=g_ref).reshape(4, 5)
    assert torch.equal(drawn, want)
    assert torch.equal(g_ours.get_state(), g_ref.get_state())


@pytest.mark.parametrize("kind", ["cross_entropy", "mse"])
def test_ranks_shares_of_the_draw_make_up_one_process_sample(kind: str) -> None:
    """Each of 3 ranks, from the same seed, keeps its rows of the global draw: together
    they sample what one process samples on the global batch, and their samplers agree."""
    loss, world = Loss.of(kind), 3
    outputs = torch.randn(world * 2, 4, 6)  # 2 windows of 4 positions per rank
    whole_gen = _gen()
    whole = loss.sample_targets(outputs, whole_gen)
    parts, states = [], []
    for rank in range(world):
        gen = _gen()
        mine = outputs[2 * rank : 2 * rank + 2]
        parts.append(loss.sample_targets(mine, gen, kaisa.kfac.losses.Share(rank, world)))
        states.append(gen.get_state())
    assert torch.equal(torch.cat(parts), whole)
    assert all(torch.equal(s, whole_gen.get_state()) for s in states)


def test_ranks_with_the_same_outputs_draw_different_noise() -> None:
    outputs = torch.zeros(5, 3)
    a = Loss.of("mse").sample_targets(outputs, _gen(), kaisa.kfac.losses.Share(0, 2))
    b = Loss.of("mse").sample_targets(outputs, _gen(), kaisa.kfac.losses.Share(1, 2))
    noise = torch.randn(10, 3, generator=_gen()) * 0.5**0.5  # the global draw, written out
    torch.testing.assert_close(a, noise[:5], rtol=0, atol=0)
    torch.testing.assert_close(b, noise[5:], rtol=0, atol=0)
    logits = torch.zeros(200, 10)  # uniform: equal classes would mean shared noise
    ca = Loss.of("cross_entropy").sample_targets(logits, _gen(), kaisa.kfac.losses.Share(0, 2))
    cb = Loss.of("cross_entropy").sample_targets(logits, _gen(), kaisa.kfac.losses.Share(1, 2))
    assert (ca == cb).float().mean() < 0.3


@pytest.mark.parametrize(("index", "count"), [(2, 2), (-1, 2), (0, 0), (0.5, 2)])
def test_a_share_outside_the_world_is_refused(index: object, count: object) -> None:
    with pytest.raises(ValueError, match="0 <= index < count"):
        kaisa.kfac.losses.Share(index, count)  # type: ignore[arg-type]
