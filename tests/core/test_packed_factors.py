"""``factor_storage='packed'``: running factors kept as their upper triangles.

Packing and unpacking copy values, and the fold is elementwise, so a packed run equals the
dense one bit for bit (the three products, accumulation, factors computed in ``step()``),
holds about half the factor bytes, and its checkpoints are the dense ones (a packed run
resumes from a dense checkpoint and the other way round, bit for bit). Distributed (2
ranks, every strategy): ``tests/distributed/test_folding_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.distributed.memory import estimate_memory
from kaisa.distributed.strategy import WorkerGrid
from tests.core.test_folding import data, net, run


@pytest.mark.parametrize(("product", "accumulation", "in_hook"), [
    ("preconditioner", 1, True), ("preconditioner", 2, True), ("preconditioner", 1, False),
    ("kfac", 1, True), ("ekfac", 2, True),
])
def test_packed_equals_dense_bit_for_bit(product: str, accumulation: int, in_hook: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    dense_params, dense_factors = run(product, accumulation=accumulation, in_hook=in_hook)
    original = kaisa.core.config.KFACConfig.__post_init__

    def packed(self: kaisa.core.config.KFACConfig) -> None:
        object.__setattr__(self, "factor_storage", "packed")
        original(self)

    monkeypatch.setattr(kaisa.core.config.KFACConfig, "__post_init__", packed)
    params, factors = run(product, accumulation=accumulation, in_hook=in_hook)
    for p, q in zip(params, dense_params, strict=True):
        assert torch.equal(p, q)
    for name, (a, g, skipped) in factors.items():
        da, dg, dskipped = dense_factors[name]
        assert skipped == dskipped
        for got, want in ((a, da), (g, dg)):
            assert (got is None) == (want is None) and (got is None or torch.equal(got, want))


def _trained(storage: str, steps: int = 3) -> tuple[nn.Module, kaisa.KFACPreconditioner,
                                                     torch.optim.SGD]:
    model = net()
    pre = kaisa.KFACPreconditioner(model, factor_storage=storage, inv_update_steps=2,
                                   inv_dtype=torch.float64)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        _step(model, pre, sgd, s)
    return model, pre, sgd


def _step(model: nn.Module, pre: kaisa.KFACPreconditioner, sgd: torch.optim.SGD, s: int) -> None:
    x, y = data(s, 0)
    sgd.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    sgd.step()


def test_half_the_factor_bytes_and_dense_views() -> None:
    _, dense, _ = _trained("dense")
    _, packed, _ = _trained("packed")
    for name, block in packed.layers.items():
        other = dense.layers[name]
        if block.diagonal:
            continue
        n = block.factors.a.shape[-1] if block.factors.a is not None else 0
        assert block.factors.a is not None and block.factors.a.dim() == 2, name
        assert torch.equal(block.a, other.a) and torch.equal(block.g, other.g)  # unpacked
        assert torch.equal(block.a_factor, other.a_factor) and n > 0
    got, want = packed.memory_usage()["factors"], dense.memory_usage()["factors"]
    assert 0.5 < got / want < 0.6, (got, want)
    dims = {"a": (100, 10), "b": (7, 3)}
    for world, workers in ((1, 1), (4, 1)):
        full = estimate_memory(dims, WorkerGrid(world, workers))
        half = estimate_memory(dims, WorkerGrid(world, workers), packed=True)
        assert half.per_rank[0]["factors"] == 4 * (5050 + 55 + 28 + 6)
        assert full.per_rank[0]["factors"] == 4 * (10000 + 100 + 49 + 9)


@pytest.mark.parametrize(("saved", "loaded"), [("packed", "dense"), ("dense", "packed")])
def test_checkpoints_are_dense_and_resume_bit_for_bit(saved: str, loaded: str) -> None:
    model, pre, sgd = _trained(saved, steps=2)
    state = pre.state_dict()
    for layer in state["layers"].values():
        assert layer["A"].dim() == 3 and layer["A"].shape[-1] == layer["A"].shape[-2]
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    sgd_state = sgd.state_dict()
    _step(model, pre, sgd, 2)
    want = [p.detach().clone() for p in model.parameters()]

    other, pre2, sgd2 = _trained(loaded, steps=0)
    other.load_state_dict(model_state)
    pre2.load_state_dict(state)
    sgd2.load_state_dict(sgd_state)
    _step(other, pre2, sgd2, 2)
    for p, q in zip(other.parameters(), want, strict=True):
        assert torch.equal(p, q)
