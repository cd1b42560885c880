"""Tied parameters: the pi-balanced Kronecker product of the per-use terms (docs/conventions.md)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F

import kaisa
from kaisa.blocks import TiedEmbeddingBlock
from kaisa.blocks.kronecker import balanced_kronecker
from kaisa.utils.enums import Side

DT = torch.float64


def _psd(n: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    m = torch.randn(n, n + 2, generator=g, dtype=DT)
    return scale * (m @ m.T) / n


def test_one_use_is_that_use() -> None:
    g = torch.Generator().manual_seed(0)
    a, gg = _psd(4, g), _psd(3, g)
    x, y = balanced_kronecker([a], [gg], [1.0])
    assert torch.equal(x, a) and torch.equal(y, gg)


@pytest.mark.parametrize("seed", range(5))
def test_it_is_the_pi_balanced_sum_and_bounds_the_sum_of_terms(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    a = [_psd(4, g), _psd(4, g, 1e-3)]
    gg = [_psd(3, g, 1e-4), _psd(3, g, 10.0)]
    w = [0.3, 0.7]
    x, y = balanced_kronecker(a, gg, w)
    # explicit: pi_u = sqrt((tr A_u / n) / (tr G_u / m)), X = sum sqrt(w) A / pi, Y = sum sqrt(w) pi G
    pis = [math.sqrt((float(ai.trace()) / 4) / (float(gi.trace()) / 3)) for ai, gi in zip(a, gg)]
    want_x = sum(math.sqrt(wi) / p * ai for ai, wi, p in zip(a, w, pis, strict=True))
    want_y = sum(math.sqrt(wi) * p * gi for gi, wi, p in zip(gg, w, pis, strict=True))
    torch.testing.assert_close(x, want_x, rtol=1e-12, atol=0)
    torch.testing.assert_close(y, want_y, rtol=1e-12, atol=0)
    target = sum(wi * torch.kron(ai, gi) for ai, gi, wi in zip(a, gg, w, strict=True))
    approx = torch.kron(x, y)
    # never less curvature than the sum of the terms in any direction ...
    assert float(torch.linalg.eigvalsh(approx - target).min()) > -1e-12 * float(approx.norm())
    # ... and at most k = 2 times its trace
    assert float(approx.trace()) <= 2 * float(target.trace()) * (1 + 1e-12)
    terms = [wi * float(torch.kron(ai, gi).trace()) for ai, gi, wi in zip(a, gg, w, strict=True)]
    assert float(approx.trace()) == pytest.approx(sum(math.sqrt(t) for t in terms) ** 2, rel=1e-10)


def test_independent_of_how_each_use_splits_its_scale() -> None:
    g = torch.Generator().manual_seed(1)
    a, gg = [_psd(5, g), _psd(5, g)], [_psd(2, g), _psd(2, g)]
    x1, y1 = balanced_kronecker(a, gg, [0.5, 0.5])
    x2, y2 = balanced_kronecker([a[0] * 1e4, a[1]], [gg[0] / 1e4, gg[1]], [0.5, 0.5])
    torch.testing.assert_close(x1, x2, rtol=1e-9, atol=0)
    torch.testing.assert_close(y1, y2, rtol=1e-9, atol=0)


def test_diagonal_factors_are_the_diagonal_matrices() -> None:
    g = torch.Generator().manual_seed(2)
    da = [torch.rand(6, generator=g, dtype=DT) for _ in range(2)]
    gg = [_psd(3, g), _psd(3, g)]
    xd, yd = balanced_kronecker(da, gg, [0.4, 0.6])
    x, y = balanced_kronecker([torch.diag(t) for t in da], gg, [0.4, 0.6])
    torch.testing.assert_close(torch.diag(xd), x, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(yd, y, rtol=1e-12, atol=1e-15)


def test_a_use_without_curvature_adds_nothing() -> None:
    g = torch.Generator().manual_seed(3)
    a, gg = [_psd(3, g), torch.zeros(3, 3, dtype=DT)], [_psd(2, g), _psd(2, g)]
    x, y = balanced_kronecker(a, gg, [0.5, 0.5])
    torch.testing.assert_close(torch.kron(x, y), 0.5 * torch.kron(a[0], gg[0]), rtol=1e-12,
                               atol=1e-15)
    x0, y0 = balanced_kronecker([torch.zeros(3, 3, dtype=DT)] * 2, gg, [0.5, 0.5])
    assert torch.equal(x0, torch.zeros(3, 3, dtype=DT))
    torch.testing.assert_close(y0, 0.5 * gg[0] + 0.5 * gg[1])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="one A, one G and one weight per use"):
        balanced_kronecker([], [], [])
    with pytest.raises(ValueError, match="one A, one G and one weight per use"):
        balanced_kronecker([torch.eye(2)], [torch.eye(2), torch.eye(2)], [1.0])


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

    x_n, y_n = balanced_kronecker([a_e, a_h], [g_e, g_h], [0.5, 0.5])
    x_d, y_d = balanced_kronecker([a_e.diagonal(), a_h.diagonal()], [g_e, g_h], [0.5, 0.5])
    # kaisa's layout: vec(grad) row-major with grad (E x V), so F ~ G (x) A
    return {
        "balanced": error(torch.kron(y_n, x_n)),
        "balanced_diagonal": error(torch.kron(y_d, torch.diag(x_d))),
        "embedding": error(torch.kron(g_e, a_e)),
        "head": error(torch.kron(g_h, a_h)),
        "sum_of_factors": error(torch.kron(g_e + g_h, a_e + a_h)),
    }


def test_the_balanced_kronecker_product_is_closer_to_the_fisher_than_one_use() -> None:
    results = [_tied_errors(seed) for seed in range(20)]
    median = {k: statistics.median(r[k] for r in results) for k in results[0]}
    # the numbers docs/conventions.md quotes
    assert median["balanced"] == pytest.approx(0.5885, abs=5e-4)
    assert median["head"] == pytest.approx(0.7123, abs=5e-4)
    assert median["embedding"] == pytest.approx(0.7464, abs=5e-4)
    assert median["sum_of_factors"] == pytest.approx(0.7420, abs=5e-4)
    assert median["balanced_diagonal"] == pytest.approx(0.6228, abs=5e-4)
    closer = sum(r["balanced"] < min(r["head"], r["embedding"]) for r in results)
    assert closer == 19



# ---------------------------------------------------------------------- the tied block
RHO = 0.5  # the first running factor is RHO I + (1 - RHO) batch factor


def _first(batch: torch.Tensor) -> torch.Tensor:
    start = torch.ones_like(batch) if batch.dim() == 1 else torch.eye(batch.shape[0], dtype=DT)
    return RHO * start + (1 - RHO) * batch

class _TiedLM(torch.nn.Module):
    """Embedding -> tanh mixing -> head tied to the embedding (optionally with a bias)."""

    def __init__(self, vocab: int = V, width: int = E, head_bias: bool = False,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=head_bias)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embedding(tokens))))


def _explicit_uses(model: _TiedLM, tokens: torch.Tensor, targets: torch.Tensor,
                   diagonal: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-use factors of docs/conventions.md, from retain_grad on both uses' outputs."""
    x = model.embedding(tokens)
    x.retain_grad()
    h = torch.tanh(model.mix(x))
    logits = model.head(h)
    logits.retain_grad()
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert x.grad is not None and logits.grad is not None
    v, e = model.embedding.weight.shape
    m = tokens.numel()
    d_e, d_h = x.grad.reshape(m, e), logits.grad.reshape(m, v)
    hh = h.detach().reshape(m, e)
    counts = torch.bincount(tokens.reshape(-1), minlength=v).to(DT)
    a_e, a_h = torch.diag(counts) / m, d_h.T @ d_h / m
    if diagonal:
        a_e, a_h = a_e.diagonal(), a_h.diagonal()
    model.zero_grad()
    return [a_e, a_h], [d_e.T @ d_e / m, hh.T @ hh / m]


def _tokens(seed: int, vocab: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (6, 4), generator=g),
            torch.randint(0, vocab, (6, 4), generator=g))


@pytest.mark.parametrize("in_hook", [True, False])
def test_the_tied_block_is_the_balanced_kronecker_product_of_both_uses(in_hook: bool) -> None:
    torch.manual_seed(0)
    model = _TiedLM().double()
    pre = kaisa.KFACPreconditioner(model, factor_decay=RHO, damping=0.1, layer_kinds="all",
                                   update_factors_in_hook=in_hook, inv_dtype=DT,
                                   kl_clip=None)
    assert list(pre.layers) == ["embedding", "mix"]
    block = pre.layers["embedding"]
    assert isinstance(block, TiedEmbeddingBlock)
    assert pre.coverage() == {"embedding.weight": "embedding", "mix.weight": "linear",
                              "mix.bias": "linear"}
    tokens, targets = _tokens(1)
    a, g = _explicit_uses(model, tokens, targets)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    grad = model.embedding.weight.grad.clone()
    pre.step()
    x, y = (_first(t) for t in balanced_kronecker(a, g, [0.5, 0.5]))
    torch.testing.assert_close(block.a_factor, x, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(block.g_factor, y, rtol=1e-10, atol=1e-14)
    # the weight's direction: (Y (x) X + damping I)^-1 vec(grad^T), row-major (E x V)
    solved = torch.linalg.solve(torch.kron(y, x) + 0.1 * torch.eye(V * E, dtype=DT),
                                grad.T.reshape(-1))
    torch.testing.assert_close(model.embedding.weight.grad, solved.reshape(E, V).T,
                               rtol=1e-8, atol=1e-12)


def test_a_vocabulary_above_the_dense_bound_is_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kaisa.blocks.tied.LARGE_FACTOR_DIM", V - 1)
    torch.manual_seed(0)
    model = _TiedLM().double()
    pre = kaisa.KFACPreconditioner(model, factor_decay=RHO, inv_dtype=DT,
                                   layer_kinds="all")
    block = pre.layers["embedding"]
    assert block.is_diagonal(Side.A) and block.factor_shape(Side.A) == (1, V)
    tokens, targets = _tokens(2)
    a, g = _explicit_uses(model, tokens, targets, diagonal=True)
    F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    pre.step()
    x, y = (_first(t) for t in balanced_kronecker(a, g, [0.5, 0.5]))
    torch.testing.assert_close(block.a_factor, x, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(block.g_factor, y, rtol=1e-10, atol=1e-14)


def test_micro_batches_average_each_use_before_combining() -> None:
    torch.manual_seed(0)
    model = _TiedLM().double()
    pre = kaisa.KFACPreconditioner(model, factor_decay=RHO, accumulation_steps=2, layer_kinds="all",
                                   inv_dtype=DT)
    parts = [_tokens(3), _tokens(4)]
    uses = [_explicit_uses(model, t, y) for t, y in parts]
    for tokens, targets in parts:
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    pre.step()
    a = [(uses[0][0][u] + uses[1][0][u]) / 2 for u in range(2)]
    g = [(uses[0][1][u] + uses[1][1][u]) / 2 for u in range(2)]
    x, y = (_first(t) for t in balanced_kronecker(a, g, [0.5, 0.5]))
    block = pre.layers["embedding"]
    torch.testing.assert_close(block.a_factor, x, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(block.g_factor, y, rtol=1e-10, atol=1e-14)


def test_the_head_bias_is_first_order_and_padding_takes_the_heads_gradient() -> None:
    torch.manual_seed(0)
    model = _TiedLM(head_bias=True, padding_idx=0).double()
    opt = kaisa.KFAC(model, loss="cross_entropy", layer_kinds="all")
    assert opt.coverage()["head.bias"] == "first-order"
    assert opt.coverage()["embedding.weight"] == "embedding"
    block = opt.curvature.blocks["embedding"]
    grad = torch.randn(V, E, dtype=DT)
    matrix = block.gradient_matrix([grad])
    assert matrix is not None
    # the head's use gives the padding row a gradient: it is not zeroed
    torch.testing.assert_close(matrix[0], grad.T, rtol=0, atol=0)
    tokens, targets = _tokens(5)
    for _ in range(3):
        loss = opt.step(lambda: (model(tokens), targets))
        assert math.isfinite(float(loss))


def test_the_tied_block_is_registered_with_embeddings_and_never_the_head_alone() -> None:
    pre = kaisa.KFACPreconditioner(_TiedLM(), layer_kinds=("linear", "embedding"))
    assert isinstance(pre.layers["embedding"], TiedEmbeddingBlock) and "head" not in pre.layers
    opt = kaisa.KFAC(_TiedLM(), loss="cross_entropy", layer_kinds=("embedding",))
    assert list(opt.curvature.blocks) == ["embedding"]
    # without embeddings (KFACPreconditioner's and KFAC's defaults) the tied weight is
    # first-order: never preconditioned from the head's use alone
    for product in (kaisa.KFACPreconditioner(_TiedLM()),
                    kaisa.KFAC(_TiedLM(), loss="cross_entropy")):
        assert product.coverage() == {"embedding.weight": "first-order", "mix.weight": "linear",
                                      "mix.bias": "linear"}
    with pytest.raises(ValueError, match="no supported layer"):
        kaisa.KFACPreconditioner(_TiedLM(), layer_kinds=("conv2d",))
    skipped = kaisa.KFACPreconditioner(_TiedLM(), layer_kinds="all", skip_layers=["head"])
    assert skipped.coverage()["embedding.weight"] == "first-order"
