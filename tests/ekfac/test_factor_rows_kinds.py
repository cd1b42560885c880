"""``factor_rows`` for attention, embedding and tied embedding/head blocks, in float64.

docs/conventions.md, "Row-subsampled factor statistics": each call of these blocks with
more than ``k`` rows draws ``k`` of them (one ``randperm`` of the product's generator when
its forward pass reaches it) and uses them for both its factors; the mean over every
subset is the full factor; a tied block's uses keep the shares of their full row counts.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import AttentionBlock, EmbeddingBlock, factors, register_blocks
from kaisa.blocks.embedding import select_indices
from kaisa.blocks.rows import flat_rows
from kaisa.blocks.tied import TiedEmbeddingBlock
from kaisa.utils.enums import KFACApprox, Side

pytestmark = pytest.mark.usefixtures("float64")

V, E = 6, 4


class Tiny(nn.Module):
    """Embedding, self-attention, a Linear and the tied head: every subsampled kind."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.attn = nn.MultiheadAttention(E, 2, batch_first=True)
        self.fc = nn.Linear(E, E)
        self.head = nn.Linear(E, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(torch.tanh(self.fc(h + a)))  # type: ignore[no-any-return]


def _tokens(step: int, n: int = 2, t: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, V, (n, t), generator=gen), torch.randint(0, V, (n, t), generator=gen)


def _train(model: nn.Module, opt: kaisa.EKFAC, step: int) -> None:
    idx, y = _tokens(step)
    opt.zero_grad()
    F.cross_entropy(model(idx).flatten(0, 1), y.flatten()).backward()
    opt.step()


def _blocks(k: int, approx: KFACApprox = KFACApprox.EXPAND, tied: bool = True,
            seed: int = 0) -> dict[str, kaisa.blocks.CurvatureBlock]:
    torch.manual_seed(0)
    return register_blocks(Tiny(tied), kfac_approx=approx, factor_rows=k,
                           kinds=("linear", "attention", "embedding"),
                           row_generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the estimators


@pytest.mark.parametrize("approx", [KFACApprox.EXPAND, KFACApprox.REDUCE])
def test_attention_mean_over_every_subset_is_the_full_factor(approx: KFACApprox) -> None:
    block = _blocks(2, approx)["attn.in_proj"]
    assert isinstance(block, AttentionBlock) and block.factor_rows == 2
    gen = torch.Generator().manual_seed(3)
    # sequence-first observations: 2 positions x 3 examples (expand: 6 rows; reduce: 3)
    x, d = torch.randn(2, 3, E, generator=gen), torch.randn(2, 3, 3 * E, generator=gen)
    m = block.row_count(x)
    assert m == block.row_count(d) == (6 if approx is KFACApprox.EXPAND else 3)
    subsets = list(itertools.combinations(range(m), 2))
    a_mean = sum(block.compute_a_batch(block.select_rows(x, torch.tensor(s)))
                 for s in subsets) / len(subsets)
    g_mean = sum(block.compute_g_batch(block.select_rows(d, torch.tensor(s)), 1.0)
                 for s in subsets) / len(subsets)
    torch.testing.assert_close(a_mean, block.compute_a_batch(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(g_mean, block.compute_g_batch(d, 1.0), rtol=0, atol=1e-12)
    if approx is KFACApprox.REDUCE:  # the examples are dimension 1: the subset's means
        rows = torch.tensor([2, 0])
        expected = factors.linear_a_factor(x[:, rows].mean(0), bias=True, dtype=torch.float64)
        torch.testing.assert_close(block.compute_a_batch(block.select_rows(x, rows)),
                                   expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_mean_over_every_subset_is_the_full_factor(tied: bool) -> None:
    block = _blocks(3, tied=tied)["emb"]
    assert isinstance(block, TiedEmbeddingBlock if tied else EmbeddingBlock)
    gen = torch.Generator().manual_seed(4)
    idx = torch.tensor([[0, 2, 2], [5, 0, 1]])
    d = torch.randn(2, 3, E, generator=gen)
    subsets = list(itertools.combinations(range(6), 3))
    a_mean = sum(block.compute_a_batch(select_indices(idx, torch.tensor(s)))
                 for s in subsets) / len(subsets)
    g_mean = sum(block.compute_g_batch(flat_rows(d, torch.tensor(s)), 1.0)
                 for s in subsets) / len(subsets)
    torch.testing.assert_close(a_mean, block.compute_a_batch(idx), rtol=0, atol=1e-12)
    torch.testing.assert_close(g_mean, block.compute_g_batch(d, 1.0), rtol=0, atol=1e-12)
    # A from the subset's counts: diag(c_S) / k, explicitly
    rows = torch.tensor([1, 2, 4])
    expected = torch.tensor([[0.0, 0.0, 2.0, 0.0, 0.0, 0.0]]) / 3
    expected[0, 0] = 1 / 3
    assert torch.equal(block.compute_a_batch(select_indices(idx, rows)), expected)


# --------------------------------------------------------------------------- pairing


@pytest.mark.parametrize("approx", [KFACApprox.EXPAND, KFACApprox.REDUCE])
def test_an_attention_call_uses_its_drawn_rows_for_both_factors(approx: KFACApprox) -> None:
    block = _blocks(2, approx, seed=9)["attn.in_proj"]
    assert isinstance(block, AttentionBlock)
    gen = torch.Generator().manual_seed(9)
    data = torch.Generator().manual_seed(5)
    calls = [(torch.randn(3, 4, E, generator=data), torch.randn(3, 4, 3 * E, generator=data))
             for _ in range(2)]  # 12 rows (expand), 4 examples (reduce)
    for x, _ in calls:  # two forward calls, then their backward passes (last first)
        block.record_input(x, in_hook=True)
    for _, d in reversed(calls):
        block.record_output_grad(d, 1.0, in_hook=True, inputs=None)
    a_sum = g_sum = 0
    for x, d in calls:
        rows = torch.randperm(block.row_count(x), generator=gen)[:2]
        a_sum += block.compute_a_batch(block.select_rows(x, rows))
        g_sum += block.compute_g_batch(block.select_rows(d, rows), 1.0)
    a, g = block.stats.take()
    assert torch.equal(a, a_sum / 2) and torch.equal(g, g_sum / 2)  # type: ignore[arg-type]
    assert torch.equal(block.row_generator.get_state(), gen.get_state())  # type: ignore[union-attr]


def test_an_untied_embedding_call_uses_its_drawn_rows_for_both_factors() -> None:
    """G of each call from the rows its forward drew for A (G rows shifted off A's fail)."""
    block = _blocks(2, tied=False, seed=7)["emb"]
    assert isinstance(block, EmbeddingBlock) and not isinstance(block, TiedEmbeddingBlock)
    gen = torch.Generator().manual_seed(7)
    data = torch.Generator().manual_seed(8)
    calls = [(torch.randint(0, V, (2, 3), generator=data), torch.randn(2, 3, E, generator=data))
             for _ in range(2)]  # 6 rows per call, 2 drawn
    for idx, _ in calls:  # two forward calls, then their backward passes (last first)
        block.record_input(idx, in_hook=True)
    for _, d in reversed(calls):
        block.record_output_grad(d, 1.0, in_hook=True, inputs=None)
    a_sum = g_sum = 0
    for idx, d in calls:
        rows = torch.randperm(6, generator=gen)[:2]
        a_sum += block.compute_a_batch(select_indices(idx, rows))
        g_sum += block.compute_g_batch(flat_rows(d, rows), 1.0)
    a, g = block.stats.take()
    assert torch.equal(a, a_sum / 2) and torch.equal(g, g_sum / 2)  # type: ignore[arg-type]
    assert torch.equal(block.row_generator.get_state(), gen.get_state())  # type: ignore[union-attr]
    # the pairing matters: the same draws with G's rows shifted give another G
    shifted = sum(block.compute_g_batch(flat_rows(d, (rows + 1) % 6), 1.0)
                  for (_, d), rows in zip(calls, _draws(7, 2), strict=True))
    assert not torch.allclose(g, shifted / 2)  # type: ignore[operator]


def _draws(seed: int, calls: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randperm(6, generator=gen)[:2] for _ in range(calls)]


@pytest.mark.parametrize("dense", [True, False])
def test_a_tied_blocks_uses_draw_their_own_rows(dense: bool) -> None:
    block = _blocks(4, seed=2)["emb"]
    assert isinstance(block, TiedEmbeddingBlock)
    if not dense:
        block.diagonal_sides = frozenset({Side.A})
    data = torch.Generator().manual_seed(6)
    idx = torch.randint(0, V, (3, 5), generator=data)
    d_e = torch.randn(3, 5, E, generator=data)
    h = torch.randn(3, 5, E, generator=data)
    d_h = torch.randn(3, 5, V, generator=data)
    # forward: embedding (site 0), head (site 1); backward: head, then embedding
    block.record_input(idx, in_hook=True, site=0)
    block.record_input(h, in_hook=True, site=1)
    block.record_output_grad(d_h, 1.0, in_hook=True, inputs=None, site=1)
    block.record_output_grad(d_e, 1.0, in_hook=True, inputs=None, site=0)
    gen = torch.Generator().manual_seed(2)
    s_e, s_h = (torch.randperm(15, generator=gen)[:4] for _ in range(2))
    a, g = block.uses.take()
    assert a is not None and g is not None
    a_e = block.compute_a_batch(idx.reshape(-1)[s_e])
    a_h_rows = d_h.reshape(-1, V)[s_h]
    a_h = (a_h_rows.square().mean(0, keepdim=True) if not dense
           else factors.linear_g_factor(a_h_rows, dtype=torch.float64))
    if dense:
        a_e = torch.diag_embed(a_e)
    # each use's stacked factor is its (1, ...) batch factor's only group
    assert torch.equal(a[0], a_e[0]) and torch.equal(a[1], a_h[0])
    assert torch.equal(g[0], factors.linear_g_factor(d_e.reshape(-1, E)[s_e],
                                                     dtype=torch.float64)[0])
    assert torch.equal(g[1], factors.linear_a_factor(h.reshape(-1, E)[s_h], bias=False,
                                                     dtype=torch.float64)[0])
    assert block.uses.weights == [0.5, 0.5]  # the full row counts, 15 each


# --------------------------------------------------------------------------- through EKFAC


def _ekfac(k: int | None, tied: bool = True) -> tuple[Tiny, kaisa.EKFAC]:
    torch.manual_seed(0)
    model = Tiny(tied)
    return model, kaisa.EKFAC(model, lr=1e-2, basis_update_steps=2, factor_rows=k, seed=1)


@pytest.mark.parametrize("tied", [False, True])
def test_every_call_of_the_model_draws_once_in_forward_order(tied: bool) -> None:
    model, opt = _ekfac(2, tied)
    _train(model, opt, 0)
    gen = torch.Generator().manual_seed(1)
    # embedding, attention in_proj, out_proj, fc, head (a block of its own untied): 6 rows
    for _ in range(5):
        torch.randperm(6, generator=gen)
    assert torch.equal(opt.row_generator.get_state(), gen.get_state())


@pytest.mark.parametrize("tied", [False, True])
def test_at_most_k_rows_is_bit_identical_to_every_row(tied: bool) -> None:
    runs = []
    for k in (None, 6):  # every call has 2 x 3 = 6 rows
        model, opt = _ekfac(k, tied)
        for step in range(3):
            _train(model, opt, step)
        runs.append((model, opt))
    (base, base_opt), (model, opt) = runs
    for p, q in zip(base.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    for name, block in base_opt.curvature.blocks.items():
        other = opt.curvature.blocks[name]
        assert torch.equal(block.a, other.a) and torch.equal(block.g, other.g), name


def test_subsampling_changes_every_kinds_factors() -> None:
    model, opt = _ekfac(3)
    base, base_opt = _ekfac(None)
    _train(base, base_opt, 0)
    _train(model, opt, 0)
    for name in ("emb", "attn.in_proj", "attn.out_proj", "fc"):
        assert not torch.equal(opt.curvature.blocks[name].g, base_opt.curvature.blocks[name].g)


def test_cross_attention_blocks_pair_every_draw() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    opt = kaisa.EKFAC(layer, lr=1e-2, factor_rows=4)
    names = set(opt.curvature.blocks)
    assert {"multihead_attn.q_proj", "multihead_attn.k_proj", "multihead_attn.v_proj",
            "self_attn.in_proj"} <= names
    gen = torch.Generator().manual_seed(7)
    tgt, memory = torch.randn(2, 3, E, generator=gen), torch.randn(2, 5, E, generator=gen)
    layer(tgt, memory).square().mean().backward()  # type: ignore[no-untyped-call]
    for name, block in opt.curvature.blocks.items():  # every forward draw met its gradient
        assert block.factor_rows == 4, name  # type: ignore[attr-defined]
        assert all(not draws for draws in block.stats.row_draws.values()), name
        assert block.stats.row_draws, name  # it drew
    opt.step()
    for name, block in opt.curvature.blocks.items():
        assert block.a is not None and block.g is not None, name
