"""``EKFACInfluence`` on 2 and 4 gloo ranks equals one process (float64, 1e-10).

Each rank fits on its contiguous shard of the training set (rank 0 the first; shards end
in short batches) with the empirical Fisher; every rank gets every score, in rank order,
equal to the single process's. On the digits MLP, and on a small byte GPT with every
block kind (attention, the tied embedding and head, norms) under every KAISA strategy
(where each block's eigendecompositions are computed and its queries preconditioned) and
under FSDP2 (``fully_shard`` on each Transformer layer and the root) and DDP.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisa.influence import EKFACInfluence
from kaisa.train.models.gpt import gpt
from tests.influence.test_anchor import _digits, _rel
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed


def _data(net: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor],
                             tuple[torch.Tensor, torch.Tensor], int]:
    if net == "mlp":
        model, train, query = _digits()  # float64
        return model, (train.tensors[0], train.tensors[1]), (
            query.tensors[0], query.tensors[1]), 16
    torch.manual_seed(0)
    model = gpt(d_model=16, n_layers=2, n_heads=2, context=12).double()
    data = torch.randint(0, 256, (48, 13), generator=torch.Generator().manual_seed(1))
    return model, (data[8:, :-1], data[8:, 1:]), (data[:8, :-1], data[:8, 1:]), 6


def _scores(rank: int | None, world: int, net: str, strategy: str, fsdp: bool = False,
            ddp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    model, (x, y), query, size = _data(net)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    if rank is not None:
        shard = len(x) // world
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.blocks:  # type: ignore[union-attr]
            fully_shard(layer)
        fully_shard(model)
    batches = [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]
    influence = EKFACInfluence(model, fisher="empirical", damping=None, dtype=torch.float64,
                               grad_worker_fraction=strategy)
    influence.fit(lambda: iter(batches))
    return influence.pairwise_scores([query], batches), influence.self_scores(batches)


def _rank(rank: int, world: int, net: str, strategy: str, fsdp: bool, ddp: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    return _scores(rank, world, net, strategy, fsdp, ddp)


def _check(world: int, net: str, strategy: str, fsdp: bool = False, ddp: bool = False) -> None:
    pairwise, self_scores = _scores(None, world, net, strategy)
    for got_pairwise, got_self in run_distributed(_rank, world, net, strategy, fsdp, ddp,
                                                  timeout=180):
        assert got_pairwise.shape == pairwise.shape and got_self.shape == self_scores.shape
        assert _rel(got_pairwise, pairwise) < 1e-10
        assert _rel(got_self, self_scores) < 1e-10


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_one_process(world: int) -> None:
    _check(world, "mlp", "comm_opt")


@pytest.mark.parametrize(("world", "strategy"), [(2, "comm_opt"), (2, "mem_opt"),
                                                 (4, "comm_opt"), (4, "mem_opt"),
                                                 (4, "hybrid_opt")])
def test_every_strategy_on_every_block_kind_equals_one_process(world: int, strategy: str
                                                               ) -> None:
    _check(world, "gpt", strategy)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_equals_one_process(world: int) -> None:
    _check(world, "gpt", "mem_opt", fsdp=True)


def test_a_ddp_model_equals_one_process() -> None:
    _check(2, "gpt", "comm_opt", ddp=True)
