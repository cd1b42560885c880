"""Tied parameters: the nearest Kronecker product of the per-use terms (docs/conventions.md)."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F

from kaisa.kronecker import nearest_kronecker

DT = torch.float64


def _psd(n: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    m = torch.randn(n, n + 2, generator=g, dtype=DT)
    return scale * (m @ m.T) / n


def _rearranged(terms: list[tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
    """Van Loan's rearrangement of ``sum w A (x) G``: ``sum w vec(A) vec(G)^T``."""
    return sum(w * torch.outer(a.reshape(-1), gg.reshape(-1)) for a, gg, w in terms)


def test_one_use_is_that_use() -> None:
    g = torch.Generator().manual_seed(0)
    a, gg = _psd(4, g), _psd(3, g)
    x, y = nearest_kronecker([a], [gg], [1.0])
    assert torch.equal(x, a) and torch.equal(y, gg)


@pytest.mark.parametrize("seed", range(5))
def test_it_is_the_frobenius_optimum(seed: int) -> None:
    # the best Kronecker approximation is the top singular pair of the rearranged sum
    g = torch.Generator().manual_seed(seed)
    a = [_psd(4, g), _psd(4, g, 1e-3)]
    gg = [_psd(3, g, 1e-4), _psd(3, g, 10.0)]
    w = [0.3, 0.7]
    x, y = nearest_kronecker(a, gg, w)
    r = _rearranged(list(zip(a, gg, w, strict=True)))
    s = torch.linalg.svdvals(r)
    best = float(torch.sqrt((s[1:] ** 2).sum()))
    target = sum(wi * torch.kron(ai, gi) for ai, gi, wi in zip(a, gg, w, strict=True))
    got = float((target - torch.kron(x, y)).norm())
    assert got == pytest.approx(best, rel=1e-9, abs=1e-15)
    # X a convex combination of the A's, both factors positive semi-definite
    assert float(torch.linalg.eigvalsh(x).min()) > -1e-12
    assert float(torch.linalg.eigvalsh(y).min()) > -1e-12
    assert float(x.trace()) <= max(float(t.trace()) for t in a) + 1e-12


def test_independent_of_how_each_use_splits_its_scale() -> None:
    g = torch.Generator().manual_seed(1)
    a, gg = [_psd(5, g), _psd(5, g)], [_psd(2, g), _psd(2, g)]
    x1, y1 = nearest_kronecker(a, gg, [0.5, 0.5])
    x2, y2 = nearest_kronecker([a[0] * 1e4, a[1]], [gg[0] / 1e4, gg[1]], [0.5, 0.5])
    torch.testing.assert_close(torch.kron(x1, y1), torch.kron(x2, y2), rtol=1e-9, atol=0)


def test_diagonal_factors_are_the_diagonal_matrices() -> None:
    g = torch.Generator().manual_seed(2)
    da = [torch.rand(6, generator=g, dtype=DT) for _ in range(2)]
    gg = [_psd(3, g), _psd(3, g)]
    xd, yd = nearest_kronecker(da, gg, [0.4, 0.6])
    x, y = nearest_kronecker([torch.diag(t) for t in da], gg, [0.4, 0.6])
    torch.testing.assert_close(torch.diag(xd), x, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(yd, y, rtol=1e-12, atol=1e-15)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="one A, one G and one weight per use"):
        nearest_kronecker([], [], [])
    with pytest.raises(ValueError, match="one A, one G and one weight per use"):
        nearest_kronecker([torch.eye(2)], [torch.eye(2), torch.eye(2)], [1.0])


# ---------------------------------------------------------------------- the measured claim
V, E, N, T = 7, 3, 200, 5


def _tied_errors(seed: int) -> dict[str, float]:
    """Errors against the exact empirical Fisher block of a tied embedding/head weight.

    Everything here is explicit math: per-example gradients for the exact block, and the
    per-use factors of docs/conventions.md from ``retain_grad`` on the two uses' outputs.
    """
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, E, generator=g, dtype=DT) * 0.7
    mix = torch.randn(E, E, generator=g, dtype=DT)
    tokens = torch.randint(0, V, (N, T), generator=g)
    targets = torch.randint(0, V, (N, T), generator=g)

    def forward(w: torch.Tensor, tok: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = w[tok]  # the embedding use
        h = torch.tanh(x @ mix)
        return x, h, h @ w.T  # the head use

    rows = []
    for n in range(N):  # vec(W.grad^T), row-major, of each example's share of the loss
        wn = weight.clone().requires_grad_(True)
        logits = forward(wn, tokens[n : n + 1])[2]
        loss = F.cross_entropy(logits.reshape(-1, V), targets[n].reshape(-1),
                               reduction="sum") / (N * T)
        (grad,) = torch.autograd.grad(loss, wn)
        rows.append(grad.T.reshape(-1))
    per_example = torch.stack(rows)
    fisher = per_example.T @ per_example

    w = weight.clone().requires_grad_(True)
    x, h, logits = forward(w, tokens)
    x.retain_grad()
    logits.retain_grad()
    F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)).backward()
    m = N * T
    assert x.grad is not None and logits.grad is not None
    d_e, d_h, hh = x.grad.reshape(m, E), logits.grad.reshape(m, V), h.detach().reshape(m, E)
    counts = torch.bincount(tokens.reshape(-1), minlength=V).to(DT)
    a_e, g_e = torch.diag(counts) / m, d_e.T @ d_e / m
    a_h, g_h = d_h.T @ d_h / m, hh.T @ hh / m

    def error(approx: torch.Tensor) -> float:  # after the best scalar scale
        c = (fisher * approx).sum() / (approx * approx).sum()
        return float((fisher - c * approx).norm() / fisher.norm())

    x_n, y_n = nearest_kronecker([a_e, a_h], [g_e, g_h], [0.5, 0.5])
    x_d, y_d = nearest_kronecker([a_e.diagonal(), a_h.diagonal()], [g_e, g_h], [0.5, 0.5])
    # kaisa's layout: vec(grad) row-major with grad (E x V), so F ~ G (x) A
    return {
        "nearest": error(torch.kron(y_n, x_n)),
        "nearest_diagonal": error(torch.kron(y_d, torch.diag(x_d))),
        "embedding": error(torch.kron(g_e, a_e)),
        "head": error(torch.kron(g_h, a_h)),
        "sum_of_factors": error(torch.kron(g_e + g_h, a_e + a_h)),
    }


def test_the_nearest_kronecker_product_is_closer_to_the_fisher_than_one_use() -> None:
    results = [_tied_errors(seed) for seed in range(20)]
    median = {k: statistics.median(r[k] for r in results) for k in results[0]}
    # the numbers docs/conventions.md quotes
    assert median["nearest"] == pytest.approx(0.5926, abs=5e-4)
    assert median["head"] == pytest.approx(0.7123, abs=5e-4)
    assert median["embedding"] == pytest.approx(0.7464, abs=5e-4)
    assert median["sum_of_factors"] == pytest.approx(0.7420, abs=5e-4)
    assert median["nearest_diagonal"] == pytest.approx(0.6246, abs=5e-4)
    closer = sum(r["nearest"] < min(r["head"], r["embedding"]) for r in results)
    assert closer == 19

