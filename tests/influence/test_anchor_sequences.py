"""Per-token and low-rank scores against Kronfluence 1.0.1 on a sequence model (slow).

A two-layer MLP applied at every position of a sequence (``nn.Linear`` on ``(N, T, F)``,
the layers Kronfluence tracks), next-position targets, fixed Fisher labels, float64:
kaisa's per-token scores (``compute_per_token_scores``) and scores of rank-2 query
gradients (``query_gradient_low_rank=2`` with ``use_full_svd``) equal Kronfluence's to
1e-10 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from kaisa.influence import EKFACInfluence
from tests.influence.test_anchor import _rel

pytestmark = pytest.mark.slow
F64 = torch.float64


def _setup() -> tuple[nn.Module, TensorDataset, TensorDataset, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 7, 6, generator=g, dtype=F64)
    y = torch.randint(0, 5, (40, 7), generator=g)
    labels = torch.randint(0, 5, (30, 7), generator=torch.Generator().manual_seed(2))
    return model, TensorDataset(x[:30], y[:30]), TensorDataset(x[30:], y[30:]), labels


def _kaisa(model: nn.Module, train: TensorDataset, labels: torch.Tensor) -> EKFACInfluence:
    influence = EKFACInfluence(model, fisher="empirical", damping=None, dtype=F64)
    x = train.tensors[0]
    influence.fit(lambda: iter([(x[i:i + 10], labels[i:i + 10]) for i in range(0, 30, 10)]))
    return influence


def _batches(data: TensorDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = data.tensors
    return [(x[i:i + 10], y[i:i + 10]) for i in range(0, len(x), 10)]


@pytest.mark.parametrize("options", [{"compute_per_token_scores": True},
                                     {"query_gradient_low_rank": 2, "use_full_svd": True}])
def test_sequence_scores_equal_kronfluence(options: dict[str, object], tmp_path: Path) -> None:
    pytest.importorskip("kronfluence", reason="kronfluence 1.0.1 is not installed")
    from tests.support.kronfluence import kronfluence_ekfac

    model, train, query, labels = _setup()
    theirs = kronfluence_ekfac(model, train, query, damping=None, batch_size=10,
                               workdir=str(tmp_path), empirical=False, fixed_labels=labels,
                               self_scores=False, score_options=dict(options))["pairwise"]
    ours = _kaisa(model, train, labels)
    if "compute_per_token_scores" in options:
        got = ours.token_scores(_batches(query), _batches(train))
    else:
        got = ours.pairwise_scores(_batches(query), _batches(train), query_rank=2)
    assert got.shape == theirs.shape
    assert _rel(got, theirs) < 1e-10
