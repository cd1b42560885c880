"""Influence on a CUDA device equals the CPU's (float64), every block kind (``gpu``).

The small byte GPT (attention, the tied embedding and head, norms, MLPs): the fit, the
pairwise, self and per-token scores on the device equal the CPU's; a fit saved on the
device loads into a CPU influence. Skipped without a CUDA device (``tests/conftest.py``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kaisa.influence import EKFACInfluence
from kaisa.train.models.gpt import gpt
from tests.influence.test_anchor import _rel

pytestmark = pytest.mark.gpu


def test_cuda_scores_equal_the_cpus(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = gpt(d_model=16, n_layers=2, n_heads=2, context=12).double()
    data = torch.randint(0, 256, (30, 13), generator=torch.Generator().manual_seed(1))
    results = []
    for device in ("cpu", "cuda"):
        here = copy.deepcopy(model).to(device)
        batches = [(data[i:i + 8, :-1].to(device), data[i:i + 8, 1:].to(device))
                   for i in range(0, 30, 8)]
        influence = EKFACInfluence(here, damping=None, seed=3, dtype=torch.float64)
        influence.fit(lambda b=batches: iter(b))
        results.append([t.cpu() for t in (influence.pairwise_scores(batches[:1], batches),
                                          influence.self_scores(batches),
                                          influence.token_scores(batches[:1], batches))])
        if device == "cuda":
            influence.save(tmp_path)
    for cpu, cuda in zip(*results, strict=True):
        assert _rel(cuda, cpu) < 1e-9
    on_cpu = EKFACInfluence(model, damping=None, dtype=torch.float64)
    on_cpu.load(tmp_path)
    batches = [(data[i:i + 8, :-1], data[i:i + 8, 1:]) for i in range(0, 30, 8)]
    assert _rel(on_cpu.pairwise_scores(batches[:1], batches), results[0][0]) < 1e-9
