"""Spread decompositions (``decomposition_spread``): the parts, the steps, the math (float64).

``docs/conventions.md``, "Spread decompositions": the blocks are split into ``k`` parts of
about equal cost; part ``j`` is decomposed at the steps ``s`` with
``s % I == (j * I) // k`` and every part at step 0, from the running factors and with the
damping of that step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.schedule import block_cost, blocks_due, parts_due, spread_parts


def test_parts_are_balanced_greedily_largest_first() -> None:
    costs = [("a", 1), ("b", 8), ("c", 5), ("d", 4), ("e", 3)]
    # b (8) -> 0, c (5) -> 1, d (4) -> 1 (5 < 8), e (3) -> 0 (8 < 9): 11 / 9; a (1) -> 1
    assert spread_parts(costs, 2) == [["b", "e"], ["a", "c", "d"]]
    assert spread_parts(costs, 1) == [["a", "b", "c", "d", "e"]]
    assert spread_parts(costs, 7)[5:] == [[], []]  # more parts than blocks: some empty
    # ties: model order among equal costs, the lowest part among equal totals
    assert spread_parts([("x", 2), ("y", 2), ("z", 2)], 2) == [["x", "z"], ["y"]]


def test_a_blocks_cost_is_n_cubed_per_dense_side_and_n_per_diagonal_side() -> None:
    pre = kaisa.KFACPreconditioner(nn.Sequential(nn.Linear(4, 6), nn.Conv2d(6, 4, 3)),
                                   layer_kinds="all")
    blocks = pre.curvature.blocks
    assert block_cost(blocks["0"]) == 5 ** 3 + 6 ** 3  # bias column: A is 5 wide
    assert block_cost(blocks["1"]) == 55 ** 3 + 4 ** 3
    emb = kaisa.KFACPreconditioner(nn.Sequential(nn.Embedding(10, 3)),
                                   layer_kinds="all").curvature.blocks["0"]
    assert emb.diagonal_sides  # an embedding's A is its diagonal
    assert block_cost(emb) == 10 + 3 ** 3


@pytest.mark.parametrize("interval", [1, 2, 5, 6, 10])
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_each_part_is_due_once_per_interval_at_its_offset(interval: int, parts: int) -> None:
    assert parts_due(0, interval, parts) == list(range(parts))
    for j in range(parts):
        steps = [s for s in range(1, 4 * interval + 1) if j in parts_due(s, interval, parts)]
        offset = (j * interval) // parts
        assert steps == [s for s in range(1, 4 * interval + 1) if s % interval == offset]
    if parts == 1:  # the reference's schedule
        assert all((parts_due(s, interval, 1) == [0]) == (s % interval == 0)
                   for s in range(40))
    names = spread_parts([(f"b{i}", i + 1) for i in range(9)], parts)
    assert blocks_due(0, interval, names) == {f"b{i}" for i in range(9)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                         nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=gen, dtype=torch.float64),
             torch.randn(8, 2, generator=gen, dtype=torch.float64)) for _ in range(steps)]


def _decompositions(pre: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per block what its decomposition does: the eigen method's operator applied to a
    fixed matrix (its eigenvectors are ill-conditioned where eigenvalues nearly repeat,
    and a batched call rounds them apart from a single one) and eigenvalues; the
    inverses as they are."""
    out = {}
    for name, b in pre.curvature.blocks.items():
        d = b.decomposition
        if "qa" not in d:
            out[name] = {k: v.clone() for k, v in d.items()}
            continue
        gen = torch.Generator().manual_seed(7)
        v = torch.randn(d["qg"].shape[-1], d["qa"].shape[-1], generator=gen,
                        dtype=d["qa"].dtype)
        applied = d["qg"] @ ((d["qg"].mT @ v @ d["qa"]) * d["dgda"]) @ d["qa"].mT
        out[name] = {"applied": applied, "da": d["da"].clone(), "dg": d["dg"].clone()}
    return out


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_a_part_holds_the_decomposition_of_its_last_due_step(method: str) -> None:
    """Weights fixed (no optimizer step), so the factors are the same in both runs: the
    spread run's block equals, at every step, the every-step run's at its last due step."""
    torch.set_default_dtype(torch.float64)
    try:
        steps, interval, k = 14, 6, 3
        damping = lambda s: 0.01 * (1 + s)  # noqa: E731  (a damping that changes)
        kwargs: dict[str, Any] = dict(factor_update_steps=1, damping=damping,
                                      compute_method=method, lr=0.1,
                                      inv_dtype=torch.float64)
        model_a, model_b = _model(), _model()
        spread = kaisa.KFACPreconditioner(model_a, inv_update_steps=interval,
                                          decomposition_spread=k, **kwargs)
        every = kaisa.KFACPreconditioner(model_b, inv_update_steps=1, **kwargs)
        history: list[dict[str, dict[str, torch.Tensor]]] = []
        for s, (x, y) in enumerate(_batches(steps)):
            for model, pre in ((model_a, spread), (model_b, every)):
                model.zero_grad()
                F.mse_loss(model(x), y).backward()
                pre.step()
            history.append(_decompositions(every))
            parts = spread.curvature.decomposition_parts
            assert len(parts) == k and all(parts)
            got = _decompositions(spread)
            for j, part in enumerate(parts):
                offset = (j * interval) // k
                last = max(t for t in range(s + 1) if t == 0 or t % interval == offset)
                for name in part:
                    for key, want in history[last][name].items():
                        torch.testing.assert_close(got[name][key], want, rtol=1e-12,
                                                   atol=1e-14, msg=f"{name}.{key} step {s}")
    finally:
        torch.set_default_dtype(torch.float32)


def test_spread_one_is_the_reference_schedule_bit_for_bit() -> None:
    results = []
    for kwargs in ({}, {"decomposition_spread": 1}):
        model = _model().double()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        pre = kaisa.KFACPreconditioner(model, inv_update_steps=3, **kwargs)
        for x, y in _batches(7):
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            pre.step()
            sgd.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_the_adaptive_optimizer_spreads_its_decompositions_too() -> None:
    model = _model().double()
    opt = kaisa.KFAC(model, loss="mse", curvature="empirical", lr=0.05, momentum=0.0,
                     inv_update_steps=4, decomposition_spread=2)
    calls: list[frozenset[str] | None] = []
    update = opt.curvature.update_decompositions

    def spy(damping: float, **kw: Any) -> None:
        calls.append(kw.get("blocks"))
        update(damping, **kw)

    opt.curvature.update_decompositions = spy  # type: ignore[method-assign]
    for x, y in _batches(6):
        opt.zero_grad()
        opt.step(lambda x=x, y=y: (model(x), y))
    parts = opt.curvature.decomposition_parts
    names = set(opt.curvature.blocks)
    # steps 0 (all), 2 (part 1: offset 4 // 2), 4 (part 0)
    assert calls == [names, set(parts[1]), set(parts[0])]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", lambda s: 2])
def test_a_bad_spread_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="decomposition_spread"):
        kaisa.KFACPreconditioner(_model(), decomposition_spread=bad)  # type: ignore[arg-type]
