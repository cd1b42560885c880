"""``nn.Embedding`` blocks: a diagonal A factor from token counts, G from output gradients.

Every expectation is the Linear rule on one-hot inputs written out here
(docs/conventions.md, "Embedding blocks and diagonal factors"): ``A = onehot^T onehot / M``
(diagonal), ``G = D^T D / M`` with ``D`` the embedding output's gradient, and the
preconditioned gradient ``(G kron A + damping I)^-1 vec(W.grad^T)`` under each method's
damping rule.
"""

from __future__ import annotations

import copy
import math
import warnings
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import EmbeddingBlock, register_blocks
from kaisa.core.config import KFACConfig
from kaisa.distributed import DistributedEngine, factor_cost, place_layers
from kaisa.distributed.strategy import WorkerGrid
from kaisa.methods import make_method
from kaisa.utils.enums import Side
from tests.support.dist import run_distributed
from tests.support.explicit import kron_solve
from tests.support.fakes import FakeCommunicator

pytestmark = pytest.mark.usefixtures("float64")

V, E, C = 7, 3, 4  # vocabulary, embedding width, classes


class _Tokens(nn.Module):
    """Embedding -> tanh -> Linear head per position; keeps the embedding output's grad."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E, padding_idx=padding_idx)
        self.head = nn.Linear(E, C)
        self.h: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if h.requires_grad:
            h.retain_grad()
        self.h = h
        return self.head(torch.tanh(h))


def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, C), targets.reshape(-1))


def _tokens(shape: tuple[int, ...], seed: int = 0, low: int = 1) -> torch.Tensor:
    """Tokens in ``[low, 5)`` (5 and 6 never seen), the first three all token 2."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(low, 5, shape, generator=g)
    tokens.view(-1)[:3] = 2
    return tokens


def _targets(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, C, shape, generator=torch.Generator().manual_seed(100 + seed))


def _counts(tokens: torch.Tensor) -> torch.Tensor:
    """``diag(onehot^T onehot / M)``, after checking that the matrix is diagonal."""
    onehot = F.one_hot(tokens.reshape(-1), V).double()
    a = onehot.T @ onehot / tokens.numel()
    assert torch.equal(a, torch.diag(torch.diagonal(a)))
    return torch.diagonal(a)


def _out_grad_factor(model: _Tokens) -> torch.Tensor:
    assert model.h is not None and model.h.grad is not None
    d = model.h.grad.reshape(-1, E)
    return d.T @ d / d.shape[0]


@pytest.mark.parametrize("shape", [(12,), (4, 3), (2, 3, 2)], ids=["1d", "NT", "NTK"])
@pytest.mark.parametrize("in_hook", [True, False], ids=["hook", "step"])
def test_factors_are_the_linear_rule_on_one_hot_inputs(
    shape: tuple[int, ...], in_hook: bool
) -> None:
    torch.manual_seed(0)
    model, rho = _Tokens(), 0.25
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", factor_decay=rho,
                                   update_factors_in_hook=in_hook, inv_dtype=torch.float64)
    tokens = _tokens(shape)
    _loss(model(tokens), _targets(shape)).backward()
    g_batch = _out_grad_factor(model)
    pre.step()
    block = pre.layers["embed"]
    assert isinstance(block, EmbeddingBlock) and block.kind == "embedding"
    assert block.dims == (V, E) and block.is_diagonal(Side.A) and not block.is_diagonal(Side.G)
    a, g = block.a_factor, block.g_factor
    assert a is not None and g is not None and a.shape == (V,) and g.shape == (E, E)
    torch.testing.assert_close(a, rho + (1 - rho) * _counts(tokens), rtol=1e-14, atol=0)
    assert torch.equal(a[[0, 5, 6]], torch.full((3,), rho))  # never seen: the decayed one
    torch.testing.assert_close(g, rho * torch.eye(E) + (1 - rho) * g_batch,
                               rtol=1e-12, atol=1e-14)


def _explicit_direction(
    method: str, grad_w: torch.Tensor, a: torch.Tensor, g: torch.Tensor, damping: float
) -> torch.Tensor:
    """The preconditioned gradient in ``W``'s layout for running ``a`` (vector), ``G``."""
    if method.startswith("eigen"):
        # vec(P) = (G kron A + damping I)^-1 vec(W.grad^T), A = diag(a)
        return kron_solve(g, torch.diag(a), grad_w.T, damping).T
    sa = sg = damping
    if method == "pi_inverse":  # pi = sqrt((tr A / V) / (tr G / E)), tr A / V = mean(a)
        pi = math.sqrt(float(a.mean()) / float(torch.trace(g) / E))
        sa, sg = pi * math.sqrt(damping), math.sqrt(damping) / pi
    # A^-1 W.grad G^-1 with the damped factors
    return torch.diag(1.0 / (a + sa)) @ grad_w @ torch.linalg.inv(g + sg * torch.eye(E))


@pytest.mark.parametrize("method", ["eigen", "eigen_no_outer", "inverse", "pi_inverse"])
def test_preconditioned_gradient_is_the_damped_kronecker_solve(method: str) -> None:
    torch.manual_seed(1)
    model, rho, damping = _Tokens(), 0.5, 0.05
    pre = kaisa.KFACPreconditioner(
        model, layer_kinds="all", factor_decay=rho, damping=damping, kl_clip=None,
        inv_dtype=torch.float64, compute_method=method.removesuffix("_no_outer"),
        compute_eigenvalue_outer_product=method != "eigen_no_outer",
    )
    tokens = _tokens((5, 4))
    _loss(model(tokens), _targets((5, 4))).backward()
    assert model.embed.weight.grad is not None
    grad_w = model.embed.weight.grad.clone()
    g_running = rho * torch.eye(E) + (1 - rho) * _out_grad_factor(model)
    pre.step()
    a_running = rho + (1 - rho) * _counts(tokens)
    want = _explicit_direction(method, grad_w, a_running, g_running, damping)
    torch.testing.assert_close(model.embed.weight.grad, want, rtol=1e-10, atol=1e-13)


def test_padding_row_stays_zero_under_the_preconditioner_and_sgd() -> None:
    torch.manual_seed(2)
    model = _Tokens(padding_idx=0)
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", damping=0.01, lr=0.5,
                                   inv_dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    for step in range(4):
        tokens = _tokens((6, 4), seed=step, low=0)
        assert bool((tokens == 0).any())
        opt.zero_grad()
        _loss(model(tokens), _targets((6, 4), seed=step)).backward()
        pre.step()
        assert model.embed.weight.grad is not None
        assert torch.equal(model.embed.weight.grad[0], torch.zeros(E))
        opt.step()
    assert torch.equal(model.embed.weight[0], torch.zeros(E))
    block = pre.layers["embed"]
    assert block.a_factor is not None and float(block.a_factor[0]) < 1.0  # padding counted


def test_padding_row_gets_no_direction_from_kfac_with_weight_decay() -> None:
    torch.manual_seed(3)
    model = _Tokens(padding_idx=0)
    with torch.no_grad():
        model.embed.weight[0] = 1.0  # weight decay would move it: the direction must not
    before = model.embed.weight.detach().clone()
    opt = kaisa.KFAC(model, loss="cross_entropy", weight_decay=0.1, damping=0.1,
                     layer_kinds="all")
    assert opt.coverage()["embed.weight"] == "embedding"
    for step in range(4):
        tokens, targets = _tokens((6, 4), seed=step, low=0), _targets((6, 4), seed=step)
        loss = opt.step(lambda tokens=tokens, targets=targets: (model(tokens), targets))
        assert loss is not None and math.isfinite(float(loss))
    assert torch.equal(model.embed.weight[0], before[0])
    assert not torch.equal(model.embed.weight[1:], before[1:])


def test_micro_batches_average_their_factors() -> None:
    torch.manual_seed(4)
    model, rho = _Tokens(), 0.5
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", factor_decay=rho,
                                   accumulation_steps=2, inv_dtype=torch.float64)
    a_parts, g_parts = [], []
    for seed, shape in enumerate([(4, 3), (2, 5)]):  # different M per micro-batch
        tokens = _tokens(shape, seed=seed)
        (_loss(model(tokens), _targets(shape, seed=seed)) / 2).backward()
        a_parts.append(_counts(tokens))
        g_parts.append(_out_grad_factor(model))
    pre.step()
    block = pre.layers["embed"]
    assert block.a_factor is not None and block.g_factor is not None
    torch.testing.assert_close(block.a_factor, rho + (1 - rho) * (a_parts[0] + a_parts[1]) / 2,
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(block.g_factor,
                               rho * torch.eye(E) + (1 - rho) * (g_parts[0] + g_parts[1]) / 2,
                               rtol=1e-12, atol=1e-14)


def _train_steps(model: _Tokens, pre: kaisa.KFACPreconditioner, steps: range) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    for step in steps:
        opt.zero_grad()
        tokens = _tokens((5, 3), seed=step)
        _loss(model(tokens), _targets((5, 3), seed=step)).backward()
        pre.step()
        opt.step()


def test_state_dict_round_trip_and_a_dense_a_is_refused() -> None:
    def build() -> tuple[_Tokens, kaisa.KFACPreconditioner]:
        torch.manual_seed(5)
        model = _Tokens()
        return model, kaisa.KFACPreconditioner(model, layer_kinds="all", inv_update_steps=3,
                                               inv_dtype=torch.float64)

    model, pre = build()
    _train_steps(model, pre, range(2))
    state = copy.deepcopy(pre.state_dict())
    saved = state["layers"]["embed"]
    assert saved["A"].shape == (1, V) and "qa" not in saved and saved["da"].shape == (1, V)
    resumed, resumed_pre = build()
    resumed.load_state_dict(model.state_dict())
    resumed_pre.load_state_dict(copy.deepcopy(state))
    _train_steps(model, pre, range(2, 5))
    _train_steps(resumed, resumed_pre, range(2, 5))
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)

    dense = copy.deepcopy(state)
    dense["layers"]["embed"]["A"] = torch.diag_embed(saved["A"])
    with pytest.raises(ValueError, match=r"layer 'embed': A has shape \(1, 7, 7\), this "
                                         r"layer's is \(1, 7\)"):
        resumed_pre.load_state_dict(dense)
    rotated = copy.deepcopy(state)
    rotated["layers"]["embed"]["qa"] = torch.eye(V).unsqueeze(0)
    with pytest.raises(ValueError, match=r"layer 'embed' has unexpected entries \['qa'\]"):
        resumed_pre.load_state_dict(rotated)


def test_a_large_vocabulary_costs_its_diagonal_and_draws_no_warning() -> None:
    vocab, width = 50_000, 8
    torch.manual_seed(6)
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Linear(width, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(model, layer_kinds="all", factor_dtype=torch.float32,
                                       inv_dtype=torch.float32)
    sizes = {(f.layer, f.side): f for f in pre.factor_sizes()}
    a = sizes[("0", Side.A)]
    assert a.dim == vocab and a.diagonal and not sizes[("0", Side.G)].diagonal
    # running + batch diagonal, and the eigenvalues: 3 V floats; a decomposition of ~V flops
    assert a.nbytes == 3 * vocab * 4 and a.gflop == vocab / 1e9
    est = pre.memory_estimates()[Fraction(1)].per_rank[0]
    lin_a, lin_g = width + 1, 2
    assert est["factors"] == (vocab + width**2 + lin_a**2 + lin_g**2) * 4
    # eigen with the outer product: dA (V), QG, dG, 1 / (dG dA^T + damping) (E x V)
    embed_decomp = vocab + width**2 + width + width * vocab
    lin_decomp = lin_a**2 + lin_a + lin_g**2 + lin_g + lin_g * lin_a
    assert est["decompositions"] == (embed_decomp + lin_decomp) * 4
    tokens = torch.randint(0, vocab, (16, 4))
    model(tokens).sum().backward()
    pre.step()
    embed = pre.layers["0"]
    assert embed.memory_usage()["factors"] == (vocab + width**2) * 4
    assert embed.memory_usage()["decompositions"] == embed_decomp * 4
    assert factor_cost(vocab, "compute", diagonal=True) == vocab
    assert factor_cost(vocab, "memory", diagonal=True) == vocab


def test_placement_balances_a_diagonal_by_its_linear_cost() -> None:
    dims = {"embed": (1000, 20), "fc": (30, 30)}
    # as a dense 1000 x 1000 factor the embedding would outweigh fc by far; as a
    # diagonal it costs 1000 + 20^3 < 2 * 30^3, so fc is placed first
    placement = place_layers(dims, WorkerGrid(2, 1),
                             diagonal_sides={"embed": frozenset({Side.A})})
    assert placement.loads == (2 * 30.0**3, 1000.0 + 20.0**3)
    dense = place_layers(dims, WorkerGrid(2, 1))
    assert dense.loads == (1000.0**3 + 20.0**3, 2 * 30.0**3)


def test_engine_averages_and_broadcasts_the_diagonal_as_a_vector() -> None:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Embedding(V, E), nn.Linear(E, 2))
    cfg = KFACConfig(compute_method="inverse", inv_dtype=torch.float64, symmetry_aware=True,
                     grad_worker_fraction="comm_opt", layer_kinds="all")
    method = make_method(cfg.compute_method)
    blocks = register_blocks(model, kinds=cfg.layer_kinds)
    for block in blocks.values():
        block.method = method
    comm = FakeCommunicator(rank=0, world_size=2,
                            peer=lambda call, buf: buf.copy_(torch.full(call.shape, 0.5)))
    engine = DistributedEngine(blocks, cfg.engine_config(torch.float64), method, communicator=comm)
    embed = blocks["0"]
    embed.stats.add_a(embed.compute_a_batch(torch.tensor([[1, 1], [2, 6]])))
    embed.stats.add_g(torch.eye(E).unsqueeze(0))
    engine.layer_done(embed)
    # the diagonal as a vector; G, a matrix, as a triangle
    assert {c.shape: c.symmetric for c in comm.calls if c.op == "allreduce"} == {
        (1, V): False, (1, E, E): True}
    (a_batch, g_batch), = engine.averaged_factors().values()
    assert a_batch is not None and torch.equal(a_batch[0], torch.tensor([0, .5, .25, 0, 0, 0, .25]))
    blocks["1"].factors.a = torch.eye(E + 1).unsqueeze(0)
    blocks["1"].factors.g = torch.eye(2).unsqueeze(0)
    embed.factors.fold(a_batch, g_batch, 0.5)
    engine.update_decompositions(0.5)
    sides = {(c.shape, c.symmetric) for c in comm.calls if c.kind == "decompositions"}
    assert ((1, V), False) in sides  # the diagonal inverse, never a triangle
    assert all(sym for shape, sym in sides if len(shape) == 3)
    a_inv = embed.decomposition["a_inv"]
    if engine.placement["0"].a_rank == 0:
        assert embed.a is not None
        torch.testing.assert_close(a_inv, 1.0 / (embed.a + 0.5))
    else:
        assert torch.equal(a_inv, torch.full((1, V), 0.5))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [({"max_norm": 1.0}, "max_norm renormalises"),
     ({"scale_grad_by_freq": True}, "scale_grad_by_freq rescales"),
     ({"sparse": True}, "sparse=True gives sparse gradients")],
)
def test_unsupported_variants_are_first_order_with_the_reason(
    kwargs: dict[str, Any], reason: str
) -> None:
    model = nn.Sequential(nn.Embedding(V, E, **kwargs), nn.Linear(E, 2))
    with pytest.warns(RuntimeWarning, match=rf"not registering '0': {reason}"):
        pre = kaisa.KFACPreconditioner(model, layer_kinds="all")
    assert pre.coverage() == {"0.weight": "first-order", "1.weight": "linear",
                              "1.bias": "linear"}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def test_a_tied_embedding_is_the_tied_block_or_first_order() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre = kaisa.KFACPreconditioner(_Tied(), layer_kinds="all")
    assert list(pre.layers) == ["embed"] and pre.coverage() == {"embed.weight": "embedding"}
    assert type(pre.layers["embed"]).__name__ == "TiedEmbeddingBlock"  # tests/blocks/test_tied.py
    pre = kaisa.KFACPreconditioner(nn.Sequential(_Tied(), nn.Linear(V, 2)),
                                   layer_kinds=("embedding", "linear"), skip_layers=["head"])
    assert pre.coverage()["0.embed.weight"] == "first-order"


class _SharedElsewhere(nn.Module):
    """An embedding whose weight a second embedding also holds (not the tied-head pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.other = nn.Embedding(V, E)
        self.other.weight = self.embed.weight
        self.out = nn.Linear(E, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens) + self.other(tokens))


def test_an_embedding_weight_shared_otherwise_is_first_order_with_a_warning() -> None:
    with pytest.warns(RuntimeWarning, match=r"not registering 'embed': its weight is tied "
                                            r"to \['other'\]"):
        pre = kaisa.KFACPreconditioner(_SharedElsewhere(), layer_kinds="all")
    assert pre.coverage()["embed.weight"] == "first-order"


class _Sequence(nn.Module):
    """Two embeddings (tokens, positions) and Linear layers: a tiny sequence classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(11, 8, padding_idx=0)
        self.positions = nn.Embedding(5, 8)
        self.hidden = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions(torch.arange(x.shape[1]))
        return self.head(torch.tanh(self.hidden(h)).mean(1))


def _sequence_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 11, (32, 5), generator=g)
    return x, (x[:, 0] % 3)


def test_embeddings_train_with_kfac_without_nan() -> None:
    torch.manual_seed(9)
    model = _Sequence()
    x, y = _sequence_batch()
    opt = kaisa.KFAC(model, loss="cross_entropy", damping=0.1, layer_kinds="all")
    assert opt.coverage()["tokens.weight"] == "embedding"
    assert opt.coverage()["positions.weight"] == "embedding"
    losses = [float(opt.step(lambda: (model(x), y))) for _ in range(8)]  # type: ignore[arg-type]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_embeddings_train_with_the_preconditioner_without_nan() -> None:
    torch.manual_seed(10)
    model = _Sequence()
    x, y = _sequence_batch()
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", damping=0.01, lr=0.1)
    default = kaisa.KFACPreconditioner(_Sequence())  # kfac-pytorch's kinds: no embedding
    assert default.coverage()["tokens.weight"] == "first-order"
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        pre.step()
        opt.step()
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _compile_train(compiled: bool) -> list[torch.Tensor]:
    torch.manual_seed(11)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3))
    pre = kaisa.KFACPreconditioner(model, layer_kinds="all", inv_dtype=torch.float64)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 10, (8, 3), generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(run(x), y).backward()
        pre.step()
        opt.step()
    assert pre.layers["0"].a is not None
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_compiled_model_trains_exactly_like_eager_without_a_dynamic_shape_break() -> None:
    dynamo.reset()
    for a, b in zip(_compile_train(False), _compile_train(True), strict=True):
        assert torch.equal(a, b)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 3))
    kaisa.KFACPreconditioner(model, layer_kinds="all")
    explained = dynamo.explain(model)(torch.randint(0, 10, (2, 3)))
    assert not explained.break_reasons  # the counts have a static shape
    assert explained.graph_break_count <= 2 * 2  # bounded by the registered layers (2)


# ---------------------------------------------------------------------- distributed
BATCH_PER_RANK = 4


def _dist_train(cfg: dict[str, Any], world: int, rank: int | None) -> list[torch.Tensor]:
    """One configuration; ``rank=None`` is the one-process reference on the global batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(9, 4, padding_idx=0), nn.Tanh(), nn.Flatten(),
                          nn.Linear(12, 6), nn.Tanh(), nn.Linear(6, 3))
    pre = kaisa.KFACPreconditioner(
        model, layer_kinds="all", grad_worker_fraction=cfg["strategy"],
        compute_method=cfg["method"], symmetry_aware=cfg["sym"],
        colocate_factors=cfg.get("colocate", True),
        allreduce_bucket_cap_mb=cfg.get("bucket", 25.0), inv_dtype=torch.float64,
        factor_decay=0.8, damping=0.01, kl_clip=0.05, lr=0.1, inv_update_steps=2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randint(0, 9, (world * BATCH_PER_RANK, 3), generator=g)
        y = torch.randint(0, 3, (world * BATCH_PER_RANK,), generator=g)
        if rank is not None:
            x = x[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
            y = y[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        opt.zero_grad()
        (F.cross_entropy(model(x), y) * (world if rank is None else 1)).backward()
        for p in model.parameters():
            assert p.grad is not None
            if rank is not None:
                torch.distributed.all_reduce(p.grad)
            p.grad.div_(world)
        pre.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _dist_job(rank: int, world: int, configs: list[dict[str, Any]]) -> list[list[torch.Tensor]]:
    torch.set_default_dtype(torch.float64)
    return [_dist_train(cfg, world, rank) for cfg in configs]


TWO_RANKS = [
    dict(strategy="comm_opt", method="eigen", sym=True),
    dict(strategy="comm_opt", method="inverse", sym=True, colocate=False),
    dict(strategy="comm_opt", method="pi_inverse", sym=False, bucket=0.0),
    dict(strategy="mem_opt", method="eigen", sym=False, colocate=False),
    dict(strategy="mem_opt", method="inverse", sym=True, bucket=0.0),
    dict(strategy="mem_opt", method="pi_inverse", sym=True),
]


def _check_ranks(configs: list[dict[str, Any]], world: int) -> None:
    results = run_distributed(_dist_job, world, configs, timeout=240)
    for i, cfg in enumerate(configs):
        want = _dist_train(cfg, world, None)
        for rank, per_rank in enumerate(results):
            for got, ref in zip(per_rank[i], want, strict=True):
                torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12,
                                           msg=f"rank {rank} vs one process: {cfg}")
            assert torch.equal(per_rank[i][0][0], torch.zeros(4))  # the padding row


@pytest.mark.distributed
def test_two_ranks_equal_one_process_for_every_strategy_and_method() -> None:
    _check_ranks(TWO_RANKS, 2)


@pytest.mark.distributed
def test_four_ranks_hybrid_opt_equal_one_process() -> None:
    _check_ranks([dict(strategy="hybrid_opt", method="eigen", sym=True, colocate=False),
                  dict(strategy="hybrid_opt", method="inverse", sym=True)], 4)
