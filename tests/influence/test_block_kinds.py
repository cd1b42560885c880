"""Influence on every block kind: attention, embeddings, a tied weight, norms, convolutions.

In float64 on a small byte GPT (tied embedding and head, ``nn.MultiheadAttention`` seen
at its functional calls, LayerNorms, a bare position parameter) and a convolutional net
(a ``Conv1d``, a grouped ``Conv2d``, BatchNorm): each kind's per-example gradient equals
one backward pass per example; ``Λ`` and the scores equal the conventions' formulas in the
fit's bases; the bases of the kinds the core records are those of the core's factors (a
``KFACPreconditioner`` on the same batch); coverage names every kind.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa.influence import EKFACInfluence
from kaisa.influence.observed import Pass
from kaisa.train.models.gpt import gpt
from tests.influence.test_anchor import _rel

F64 = torch.float64
Batch = tuple[torch.Tensor, torch.Tensor]


def _gpt() -> tuple[nn.Module, list[Batch]]:
    torch.manual_seed(0)
    model = gpt(d_model=16, n_layers=2, n_heads=2, context=12).double()
    data = torch.randint(0, 256, (30, 13), generator=torch.Generator().manual_seed(1))
    return model, [(data[i:i + 8, :-1], data[i:i + 8, 1:]) for i in range(0, 30, 8)]


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding="same", groups=2)
        self.norm = nn.BatchNorm2d(4)
        self.emb = nn.Embedding(7, 4)
        self.fc = nn.Linear(4 * 16 + 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x[:, :32].reshape(-1, 2, 16)))  # (N, 4, 16)
        h = self.norm(self.c2(h.reshape(-1, 4, 4, 4))).flatten(1)
        e = self.emb(x[:, 32].long().clamp(0, 6))
        return self.fc(torch.cat([h, e], dim=1))  # type: ignore[no-any-return]


def _convs() -> tuple[nn.Module, list[Batch]]:
    torch.manual_seed(0)
    model = _Convs().double().eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 33, generator=g, dtype=F64)
    x[:, 32] = torch.randint(0, 7, (30,), generator=g).double()
    y = torch.randint(0, 5, (30,), generator=g)
    return model, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 30, 8)]


def _loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1),
                           reduction="sum")


def _loop(influence: EKFACInfluence, batch: Batch) -> dict[str, torch.Tensor]:
    """Each example's gradient matrices, one backward pass per example."""
    model, blocks = influence.model, influence.blocks
    out: dict[str, list[torch.Tensor]] = {name: [] for name in blocks}
    inputs, targets = batch
    for n in range(len(inputs)):
        for name, block in blocks.items():
            params = list(block.parameters())
            loss = _loss(model(inputs[n:n + 1]), targets[n:n + 1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            matrix = block.gradient_matrix(
                [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads,
                                                                        strict=True)])
            assert matrix is not None
            out[name].append(matrix)
    return {name: torch.stack(ms) for name, ms in out.items()}


MODELS = {"gpt": _gpt, "convs": _convs}


@pytest.mark.parametrize("net", sorted(MODELS))
def test_every_kinds_example_gradients_equal_one_pass_per_example(net: str) -> None:
    model, batches = MODELS[net]()
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64)
    kinds = set(influence.coverage().values())
    want = {"gpt": {"embedding", "attention", "linear", "scale_shift", "first-order"},
            "convs": {"conv1d", "conv2d", "scale_shift", "embedding", "linear"}}[net]
    assert kinds == want
    inputs, targets = batches[0]
    with influence._observer.installed():
        passed = influence._observer.run(inputs, lambda out: _loss(out, targets))
        got = {name: sum(p.matrices() for p in parts)
               for name, parts in influence._parts(passed).items()}
    model.eval()
    for name, expected in _loop(influence, batches[0]).items():
        mine = got[name]
        assert isinstance(mine, torch.Tensor) and mine.shape == expected.shape, name
        assert _rel(mine, expected) < 1e-12, name


@pytest.mark.parametrize("net", sorted(MODELS))
def test_every_kinds_lambda_and_scores_equal_the_conventions_in_the_fits_bases(
        net: str) -> None:
    model, batches = MODELS[net]()
    influence = EKFACInfluence(model, fisher="empirical", damping=None, dtype=F64)
    influence.fit(lambda: iter(batches))
    model.eval()
    grads = [_loop(influence, b) for b in batches]
    total = torch.zeros(8, 30, dtype=F64)
    for name, f in influence._factors.items():
        qa = f.qa if f.qa is not None else None
        qs = f.qs if f.qs is not None else None

        def rotate(g: torch.Tensor, qa: torch.Tensor | None = qa,
                   qs: torch.Tensor | None = qs) -> torch.Tensor:
            if qs is not None:
                g = torch.einsum("kji,nkjc->nkic", qs, g)
            return g if qa is None else torch.einsum("nkrj,kjc->nkrc", g, qa)

        every = torch.cat([rotate(g[name]) for g in grads])
        lam = every.square().mean(0)
        assert _rel(f.lam(), lam) < 1e-12, name
        damping = 0.1 * float(lam.mean())
        assert abs(influence.block_damping(name) - damping) <= 1e-12 * damping
        query = rotate(grads[0][name]) / (lam + damping)
        total += query.flatten(1) @ every.flatten(1).T  # <P(G_q), G_t> in the rotated frame
    scores = influence.pairwise_scores(batches[:1], batches)
    assert _rel(scores, total) < 1e-10
    assert _rel(influence.self_scores(batches)[:8], total[:, :8].diagonal()) < 1e-10


def _seeded_after_one_step(model: nn.Module, one: list[Batch]) -> EKFACInfluence:
    """Fitted on ``one`` with the bases of a ``KFACPreconditioner``'s running factors after
    one step on it (decay 1e-14: the running factors are that batch's)."""
    import kaisa
    from kaisa.influence import running_factors

    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", factor_decay=1e-14,
                                   factor_update_steps=1, inv_update_steps=1)
    inputs, targets = one[0]
    _loss(model(inputs), targets).backward()
    pre.step()
    seeded = EKFACInfluence(model, fisher="empirical", dtype=F64)
    seeded.fit(lambda: iter(one), factors=running_factors(pre))
    return seeded


def test_the_core_kinds_bases_are_the_products_factors() -> None:
    """Seeded from a ``KFACPreconditioner``'s running factors after one step on the one
    batch (decay 1e-14: the running factors are that batch's), the scores equal the fit's:
    the kinds the core records (attention, the tied embedding and head) have the core's
    factors, at any scale."""

    model, batches = _gpt()
    one = batches[:1]
    fit = EKFACInfluence(model, fisher="empirical", dtype=F64)
    fit.fit(lambda: iter(one))
    seeded = _seeded_after_one_step(model, one)
    kinds = {type(b).__name__ for b in seeded.blocks.values()}
    assert {"AttentionBlock", "TiedEmbeddingBlock", "LinearBlock"} <= kinds
    assert _rel(seeded.pairwise_scores(one, batches), fit.pairwise_scores(one, batches)) < 1e-8


@pytest.mark.parametrize("net", sorted(MODELS))
def test_token_scores_are_each_rows_terms_and_sum_to_the_pairwise_scores(net: str) -> None:
    """Per-token scores: every layer's rows are the same positions (the GPT's tokens; the
    convolutional net's rows differ, refused in one line)."""
    model, batches = MODELS[net]()
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64)
    influence.fit(lambda: iter(batches))
    if net == "convs":
        with pytest.raises(ValueError, match="rows to be the same positions"):
            influence.token_scores(batches[:1], batches)
        return
    tokens = influence.token_scores(batches[:1], batches)
    assert tokens.shape == (8, 30, 12)
    assert _rel(tokens.sum(-1), influence.pairwise_scores(batches[:1], batches)) < 1e-10
    # one Linear block's terms against g_r^T P a_r written out
    p = influence._preconditioned_queries(batches[:1], _loss, None)["blocks.0.linear1"].dense()
    inputs, targets = batches[1]
    with influence._observer.installed():
        passed = influence._observer.run(inputs, lambda out: _loss(out, targets))
    (x, d, _), = passed.calls["blocks.0.linear1"]
    a = torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=F64)], dim=-1)  # (8, 12, 17)
    want = torch.einsum("qoi,nri,nro->qnr", p[:, 0], a, d)
    got = influence._parts(passed)["blocks.0.linear1"][0].per_row(p)
    assert _rel(got, want) < 1e-12


def test_low_rank_queries_score_the_truncated_matrices() -> None:
    model, batches = _gpt()
    influence = EKFACInfluence(model, fisher="empirical", dtype=F64)
    influence.fit(lambda: iter(batches))
    exact = influence.pairwise_scores(batches[:1], batches)
    assert _rel(influence.pairwise_scores(batches[:1], batches, query_rank=256), exact) < 1e-10
    whole = influence._preconditioned_queries(batches[:1], _loss, None)
    want = torch.zeros(8, 30, dtype=F64)
    for name, q in whole.items():
        u, s, vh = torch.linalg.svd(q.dense(), full_matrices=False)
        truncated = u[..., :2] * s[..., None, :2] @ vh[..., :2, :]
        grads = torch.cat([sum(p.matrices() for p in influence._parts(
            _pass(influence, b))[name]) for b in batches])  # type: ignore[misc]
        want += truncated.flatten(1) @ grads.flatten(1).T
    got = influence.pairwise_scores(batches[:1], batches, query_rank=2)
    assert _rel(got, want) < 1e-10 and _rel(got, exact) > 1e-3
    with pytest.raises(ValueError, match="query_rank must be a positive integer"):
        influence.pairwise_scores(batches[:1], batches, query_rank=0)


def _pass(influence: EKFACInfluence, batch: Batch) -> Pass:
    inputs, targets = batch
    with influence._observer.installed():
        return influence._observer.run(inputs, lambda out: _loss(out, targets))


def test_a_tied_weight_with_a_diagonal_vocabulary_side(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """A vocabulary above the dense limit (as a real language model's): the tied block's
    vocabulary side is diagonal, its width side keeps the combined factor's basis (equal
    to a ``KFACPreconditioner``'s on the same batch), and a saved fit loads back."""
    import kaisa.blocks.tied as tied

    monkeypatch.setattr(tied, "LARGE_FACTOR_DIM", 64)  # 256 bytes: diagonal
    model, batches = _gpt()
    one = batches[:1]
    fit = EKFACInfluence(model, fisher="empirical", dtype=F64)
    fit.fit(lambda: iter(one))
    f = fit._factors["embedding"]
    assert f.qa is None and f.qs is not None and f.qs.shape == (1, 16, 16)
    seeded = _seeded_after_one_step(model, one)
    want = fit.pairwise_scores(one, batches)
    assert _rel(seeded.pairwise_scores(one, batches), want) < 1e-8
    fit.save(tmp_path)
    again = EKFACInfluence(model, fisher="empirical", dtype=F64)
    again.load(tmp_path)
    assert torch.equal(again.pairwise_scores(one, batches), want)
