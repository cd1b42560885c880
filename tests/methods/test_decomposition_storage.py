"""Decompositions hold their own bytes: no entry keeps a larger batched result alive.

Factors of one size are decomposed in one batched call; a block whose result stayed a view
of that batch (a block not restacked with the others: a singleton shape, a diagonal
side, a block this rank sends to others) would keep every other member's result alive, so
the decompositions' memory would exceed what ``memory_usage()`` and the memory model
count (ResNet-20: 12.1 MB held for 10.0 MB of entries).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa


def _held_and_counted(pre: kaisa.KFACPreconditioner) -> tuple[int, int]:
    storages: dict[int, int] = {}
    counted = 0
    for layer in pre.layers.values():
        for t in layer.decomposition.values():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            counted += t.numel() * t.element_size()
    return sum(storages.values()), counted


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_no_decomposition_keeps_its_batch_alive(method: str) -> None:
    torch.manual_seed(0)
    # two 8x8 Linears (restacked together) and an 8 -> 16 one alone, all of whose A
    # factors (and the two G's) are decomposed in one batch of size 8
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False),
                          nn.Tanh(), nn.Linear(8, 16, bias=False), nn.Tanh(),
                          nn.Linear(16, 4))
    pre = kaisa.KFACPreconditioner(model, compute_method=method, inv_update_steps=2)
    x = torch.randn(32, 8)
    for _ in range(3):  # decompose, precondition (restack), decompose again
        model.zero_grad()
        F.mse_loss(model(x), torch.zeros(32, 4)).backward()
        pre.step()
        held, counted = _held_and_counted(pre)
        assert held == counted
    assert pre.memory_usage()["decompositions"] == counted
