"""The hooks' operator calls: a few per factor, none that reads a value on the host.

A forward and backward pass that records statistics adds, per registered Kronecker
block, the factor kernels, one ``fold`` (both factors into the running factors) and a
handful of calls (on the CPU: one ``aminmax`` per factor for the overflow guard, whose values are
read from memory, and the layout calls of a Linear or a convolution's G factor), never a
``detach`` of what is used at once, and never a host read (``item``). ``bench/step_cost/launches.py`` counts the same for
ResNet-50 and the GPT.
"""

from __future__ import annotations

import collections
import copy

import torch
from torch import nn

import kaisa
from tests.support.calls import Calls


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1, bias=False), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 10),
    )


def _fwd_bwd(model: nn.Module, x: torch.Tensor) -> collections.Counter[str]:
    calls = Calls()
    with calls:
        model(x).square().sum().backward()
    return calls.calls


def test_recording_adds_a_few_calls_per_factor_and_no_host_read() -> None:
    model = _net()
    plain = copy.deepcopy(model)
    pre = kaisa.KFACPreconditioner(model)
    x = torch.randn(2, 3, 6, 6)
    for net in (model, plain):  # the gradients exist in both
        net(x).square().sum().backward()
    pre.step()  # the running factors exist: a steady step from here on
    recorded, baseline = _fwd_bwd(model, x), _fwd_bwd(plain, x)
    extra = recorded - baseline
    blocks = 4
    assert extra["aten.aminmax"] == 2 * blocks  # one overflow guard per factor
    assert extra["kaisa.fold"] == blocks  # a block's factors folded where computed, one call
    assert recorded["aten.detach"] == baseline["aten.detach"]  # nothing used at once detached
    assert "aten._local_scalar_dense" not in recorded  # no host read, no sync on a GPU
    # 42 here on the CPU: 38 (a grouped convolution's G is a batched product and its layout
    # calls) and the 4 folds, which step() no longer makes; each factor took about 18
    # calls before the guard was read from memory
    assert sum(extra.values()) <= 12 * blocks, extra
