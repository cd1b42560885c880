"""``EKFACInfluence`` on 2 and 4 gloo ranks equals one process (float64, 1e-10).

Each rank fits on its contiguous shard of the 200 digits (rank 0 the first; 200 / 4 is
not a multiple of the batch, so shards end in short batches) with the empirical Fisher;
every rank gets every score, in rank order, equal to the single process's.
"""

from __future__ import annotations

import pytest
import torch

from kaisa.influence import EKFACInfluence
from tests.influence.test_anchor import _digits, _rel
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed


def _scores(rank: int | None, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    model, train, query = _digits()  # float64
    x, y = train.tensors
    if rank is not None:
        shard = len(x) // world
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
    influence = EKFACInfluence(model, fisher="empirical", damping=None, dtype=torch.float64)
    influence.fit(lambda: iter(batches))
    queries = [(query.tensors[0], query.tensors[1])]
    return influence.pairwise_scores(queries, batches), influence.self_scores(batches)


def _rank(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _scores(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_one_process(world: int) -> None:
    pairwise, self_scores = _scores(None, world)
    for got_pairwise, got_self in run_distributed(_rank, world, timeout=120):
        assert got_pairwise.shape == (20, 200) and got_self.shape == (200,)
        assert _rel(got_pairwise, pairwise) < 1e-10
        assert _rel(got_self, self_scores) < 1e-10
