"""Row-subsampled factor statistics (``kaisa.EKFAC(factor_rows=k)``), in float64.

docs/conventions.md, "Row-subsampled factor statistics": each call of a Linear block
with more than ``k`` rows uses ``k`` rows drawn without replacement (the first ``k`` of a
``randperm`` of the product's generator), the same for ``A`` and ``G``; the expectation
over the subsets is the full factor.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import LinearBlock, factors, register_blocks
from kaisa.utils.enums import KFACApprox

pytestmark = pytest.mark.usefixtures("float64")


class Net(nn.Module):
    """Two Linear blocks on sequences ``(N, T, 3)``; ``twice`` calls ``fc2`` twice."""

    def __init__(self, *, twice: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)
        self.fc2 = nn.Linear(4, 4, bias=False)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return torch.tanh(self.fc2(h)) if self.twice else h


def _net(twice: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(twice=twice)


def _batch(step: int, n: int = 3, t: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, t, 3, generator=gen), torch.randn(n, t, 4, generator=gen)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def _train(model: nn.Module, opt: kaisa.EKFAC, step: int) -> None:
    opt.zero_grad()
    _loss(model, _batch(step)).backward()
    opt.step()


def _block(approx: KFACApprox = KFACApprox.EXPAND, k: int = 2,
           seed: int = 0) -> tuple[nn.Linear, LinearBlock]:
    torch.manual_seed(1)
    layer = nn.Linear(3, 4)
    blocks = register_blocks(nn.Sequential(layer), kfac_approx=approx, factor_rows=k,
                             row_generator=torch.Generator().manual_seed(seed))
    block = blocks["0"]
    assert isinstance(block, LinearBlock) and block.factor_rows == k
    return layer, block


# --------------------------------------------------------------------------- the estimator


@pytest.mark.parametrize("approx", [KFACApprox.EXPAND, KFACApprox.REDUCE])
@pytest.mark.parametrize("k", [2, 3])
def test_mean_over_every_subset_is_the_full_factor(approx: KFACApprox, k: int) -> None:
    _, block = _block(approx, k)
    gen = torch.Generator().manual_seed(3)
    # M = 6 rows: 2 sequences of 3 positions (expand), 6 examples of 2 (reduce).
    shape = (2, 3) if approx is KFACApprox.EXPAND else (6, 2)
    x = torch.randn(*shape, 3, generator=gen)
    d = torch.randn(*shape, 4, generator=gen)
    m = block.row_count(x)
    assert m == block.row_count(d) == 6
    subsets = list(itertools.combinations(range(m), k))
    assert len(subsets) == math.comb(6, k)
    a_mean = torch.zeros(1, 4, 4)
    g_mean = torch.zeros(1, 4, 4)
    for s in subsets:
        rows = torch.tensor(s)
        a_mean += block.compute_a_batch(block.select_rows(x, rows)) / len(subsets)
        g_mean += block.compute_g_batch(block.select_rows(d, rows), 1.0) / len(subsets)
    torch.testing.assert_close(a_mean, block.compute_a_batch(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(g_mean, block.compute_g_batch(d, 1.0), rtol=0, atol=1e-12)


def test_monte_carlo_through_the_generator_approaches_the_full_factor() -> None:
    _, block = _block(KFACApprox.EXPAND, 3)
    gen = torch.Generator().manual_seed(4)
    x, d = torch.randn(2, 4, 3, generator=gen), torch.randn(2, 4, 4, generator=gen)
    draws = 4000
    for _ in range(draws):
        block.record_input(x, in_hook=True)
        block.record_output_grad(d, 1.0, in_hook=True, inputs=None)
    assert block.stats.row_draws == {0: []}  # every draw popped by its gradient
    a, g = block.stats.take()
    assert a is not None and g is not None
    full_a, full_g = block.compute_a_batch(x), block.compute_g_batch(d, 1.0)
    assert float((a - full_a).abs().max()) < 0.05 * float(full_a.abs().max())
    assert float((g - full_g).abs().max()) < 0.05 * float(full_g.abs().max())
    assert not torch.equal(a, full_a)


def test_linear_attention_and_embedding_blocks_subsample() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.conv = nn.Conv1d(4, 4, 1)
            self.fc = nn.Linear(4, 4)
            self.emb = nn.Embedding(5, 4)

    blocks = register_blocks(Mixed(), kinds=("linear", "conv1d", "attention", "embedding"),
                             factor_rows=2, row_generator=torch.Generator())
    rows = {name: getattr(b, "factor_rows", None) for name, b in blocks.items()}
    assert rows == {"attn.in_proj": 2, "attn.out_proj": 2, "conv": None, "fc": 2, "emb": 2}


# --------------------------------------------------------------------------- through EKFAC


@pytest.mark.parametrize("twice", [False, True])
def test_a_and_g_use_the_same_drawn_rows(twice: bool) -> None:
    k, seed = 4, 7
    model = _net(twice)
    reference = copy.deepcopy(model)
    opt = kaisa.EKFAC(model, lr=1e-2, factor_rows=k, seed=seed, factor_decay=0.5)
    batch = _batch(0)
    # The expected factors: the draws in forward order, each call's output gradient.
    gen = torch.Generator().manual_seed(seed)
    calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {"fc1": [], "fc2": []}
    outputs: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            out.retain_grad()
            outputs.append((name, args[0].detach(), out))
        return hook

    for name in calls:
        getattr(reference, name).register_forward_hook(keep(name))
    _loss(reference, batch).backward()
    for name, x, out in outputs:
        assert out.grad is not None
        rows = torch.randperm(x.shape[0] * x.shape[1], generator=gen)[:k]
        calls[name].append((x.reshape(-1, x.shape[-1])[rows],
                            out.grad.reshape(-1, out.shape[-1])[rows]))
    assert len(calls["fc2"]) == (2 if twice else 1)

    opt.zero_grad()
    _loss(model, batch).backward()
    opt.step()
    assert torch.equal(opt.row_generator.get_state(), gen.get_state())
    for name, uses in calls.items():
        block = opt.curvature.blocks[name]
        a = sum(factors.linear_a_factor(x, bias=block.has_bias, dtype=torch.float64)
                for x, _ in uses)
        g = sum(factors.linear_g_factor(d, dtype=torch.float64) for _, d in uses)
        assert isinstance(a, torch.Tensor) and isinstance(g, torch.Tensor)
        # zero_start with decay 1/2: the running factor is half the step's batch factor.
        assert torch.equal(block.a, a / len(uses) * 0.5), name
        assert torch.equal(block.g, g / len(uses) * 0.5), name


def test_at_most_k_rows_is_bit_identical_to_every_row() -> None:
    runs = []
    for rows in (None, 15, 1000):  # the calls have 3 * 5 = 15 rows
        model = _net()
        opt = kaisa.EKFAC(model, lr=1e-2, basis_update_steps=2, factor_rows=rows)
        for step in range(4):
            _train(model, opt, step)
        assert torch.equal(opt.row_generator.get_state(),
                           torch.Generator().manual_seed(0).get_state())  # never drawn
        runs.append((model, opt))
    (base, base_opt), *others = runs
    for model, opt in others:
        for p, q in zip(base.parameters(), model.parameters(), strict=True):
            assert torch.equal(p, q)
        for name, block in base_opt.curvature.blocks.items():
            other = opt.curvature.blocks[name]
            assert torch.equal(block.a, other.a) and torch.equal(block.g, other.g)


def test_subsampling_changes_the_factors() -> None:
    model = _net()
    opt = kaisa.EKFAC(model, lr=1e-2, factor_rows=4)
    _train(model, opt, 0)
    other = _net()
    full = kaisa.EKFAC(other, lr=1e-2)
    _train(other, full, 0)
    assert not torch.equal(opt.curvature.blocks["fc1"].a, full.curvature.blocks["fc1"].a)
    assert not torch.equal(opt.row_generator.get_state(),
                           torch.Generator().manual_seed(0).get_state())


def _states_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            _states_equal(x, y)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), key
        else:
            assert x == y, key


def test_resume_is_bit_exact() -> None:
    kw: dict[str, Any] = dict(lr=2e-2, basis_update_steps=2, factor_rows=4, seed=3)
    model = _net()
    opt = kaisa.EKFAC(model, **kw)
    for step in range(3):
        _train(model, opt, step)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(3, 6):
        _train(model, opt, step)
    resumed = _net()
    again = kaisa.EKFAC(resumed, **kw)
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    assert torch.equal(again.row_generator.get_state(), saved[1]["kaisa"]["generator"])
    for step in range(3, 6):
        _train(resumed, again, step)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    _states_equal(opt.state_dict(), again.state_dict())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_carries_the_generator(tmp_path: Any) -> None:
    kw: dict[str, Any] = dict(lr=2e-2, basis_update_steps=2, factor_rows=4, seed=5)
    model = _net()
    opt = kaisa.EKFAC(model, **kw)
    for step in range(3):
        _train(model, opt, step)
    kaisa.checkpoint.save(str(tmp_path / "ckpt"), model, opt)
    for step in range(3, 5):
        _train(model, opt, step)
    resumed = _net()
    again = kaisa.EKFAC(resumed, **kw)
    kaisa.checkpoint.load(str(tmp_path / "ckpt"), resumed, again)
    for step in range(3, 5):
        _train(resumed, again, step)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    assert torch.equal(opt.row_generator.get_state(), again.row_generator.get_state())


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("value", [0, -3, True, False, 2.0, "4", [4]])
def test_bad_factor_rows_raise(value: object) -> None:
    with pytest.raises(ValueError, match="factor_rows"):
        kaisa.EKFAC(_net(), factor_rows=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, -1, 1.5, "0", 2**63])
def test_bad_seed_raises(value: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        kaisa.EKFAC(_net(), factor_rows=2, seed=value)  # type: ignore[arg-type]


def test_factor_rows_needs_factors_in_the_hooks() -> None:
    with pytest.raises(ValueError, match="update_factors_in_hook"):
        kaisa.EKFAC(_net(), factor_rows=2, update_factors_in_hook=False)
    kaisa.EKFAC(_net(), update_factors_in_hook=False)  # without factor_rows: fine


@pytest.mark.parametrize("generator", [
    "state", 3, torch.zeros(5, dtype=torch.uint8), torch.zeros(5056), [0] * 5056,
])
def test_a_malformed_generator_loads_nothing(generator: object) -> None:
    model = _net()
    opt = kaisa.EKFAC(model, lr=1e-2, factor_rows=4)
    for step in range(2):
        _train(model, opt, step)
    state = opt.state_dict()
    good = copy.deepcopy(state)
    state["kaisa"]["generator"] = generator
    state["kaisa"]["steps"] = 7
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="generator"):
        opt.load_state_dict(state)
    assert opt.steps == 2
    _states_equal(before, opt.state_dict())
    gathered = opt.state_dict(gather=True)
    for every in ([generator], [], [gathered["kaisa"]["generator"]] * 2, generator):
        gathered["kaisa"]["generators"] = every
        gathered["kaisa"]["steps"] = 7
        with pytest.raises(ValueError, match="generator"):
            opt.load_state_dict(gathered)
        assert opt.steps == 2
        _states_equal(before, opt.state_dict())
    opt.load_state_dict(good)  # the unchanged state still loads


def test_a_gathered_state_holds_every_ranks_generator() -> None:
    model = _net()
    opt = kaisa.EKFAC(model, lr=1e-2, factor_rows=4)
    _train(model, opt, 0)
    state = opt.state_dict(gather=True)
    mine = opt.row_generator.get_state()
    assert len(state["kaisa"]["generators"]) == 1
    assert torch.equal(state["kaisa"]["generators"][0], mine)
    again = kaisa.EKFAC(_net(), lr=1e-2, factor_rows=4)
    state["kaisa"]["generator"] = torch.Generator().manual_seed(9).get_state()  # not used
    again.load_state_dict(state)
    assert torch.equal(again.row_generator.get_state(), mine)
