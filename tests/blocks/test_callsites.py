"""Call sites: a block observed through several modules, or through functional calls.

The recorder (:mod:`kaisa.core.hooks`) is driven directly with small test kinds: a Linear
weight shared by two modules (one block, told which module each use came from), and
rows of a weight that a parent module multiplies by with ``F.linear`` in its forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import LinearBlock
from kaisa.blocks.callsites import CallSite
from kaisa.core.hooks import StatisticsRecorder
from tests.support.explicit import linear_g_batch, rows_a

pytestmark = pytest.mark.usefixtures("float64")

TIGHT = {"rtol": 1e-10, "atol": 1e-12}


class _Twice(LinearBlock):
    """A test kind: one Linear weight observed through two modules that share it."""

    def __init__(self, first: nn.Linear, second: nn.Linear) -> None:
        self.second = second
        super().__init__(name="shared", module=first, factor_dtype=None)
        self.seen: list[int] = []

    def call_sites(self) -> tuple[CallSite, ...]:
        return (CallSite(self.module), CallSite(self.second))

    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        self.seen.append(site)
        super().record_input(x, in_hook=in_hook, site=site)


class _Functional(LinearBlock):
    """A test kind: rows ``2:5`` of a weight a parent uses with ``F.linear`` in its forward."""

    def __init__(self, parent: nn.Module, linear: nn.Linear) -> None:
        self.parent = parent
        super().__init__(name="rows", module=linear, factor_dtype=None)
        self.rows = (slice(2, 5), slice(2, 5))

    def call_sites(self) -> tuple[CallSite, ...]:
        return (CallSite(self.parent, weight=self.module.weight, rows=slice(2, 5),
                         mismatch="rows 2:5 used in part"),)


@pytest.mark.parametrize("in_hook", [True, False])
def test_a_block_observed_through_two_modules_learns_the_site_of_each_use(
    in_hook: bool,
) -> None:
    first = nn.Linear(4, 3)
    second = nn.Linear(4, 3)
    second.weight, second.bias = first.weight, first.bias
    block = _Twice(first, second)
    done: list[str] = []
    ends: list[int] = []
    recorder = StatisticsRecorder({"shared": block}, in_hook=in_hook, grad_scaler=None,
                                  accumulation_steps=1,
                                  on_layer_done=lambda b: done.append(b.name),
                                  on_backward_end=lambda: ends.append(1),
                                  timings={"factors": 0.0})
    recorder.recording = True
    x1, x2 = torch.randn(5, 4), torch.randn(2, 4)
    y1, y2 = first(x1), second(x2)
    y1.retain_grad()
    y2.retain_grad()
    (y1.square().sum() + y2.sin().sum()).backward()
    recorder.compute_saved()
    assert block.seen == ([0, 1] if in_hook else [0, 1, 0, 1])
    assert (ends, done) == (([1], ["shared"]) if in_hook else ([], []))  # as for every block
    a, g = block.stats.take()
    assert a is not None and g is not None
    torch.testing.assert_close(a[0], (rows_a(x1, bias=True) + rows_a(x2, bias=True)) / 2, **TIGHT)
    assert y1.grad is not None and y2.grad is not None
    torch.testing.assert_close(g[0], (linear_g_batch(y1.grad)[0] + linear_g_batch(y2.grad)[0]) / 2, **TIGHT)
    recorder.remove()


def test_a_block_observed_through_functional_calls_gets_its_rows_of_the_product() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor, part: bool = False) -> torch.Tensor:
            w, b = self.proj.weight, self.proj.bias
            if part:  # rows 3:6 only: overlaps the block's rows 2:5 without containing them
                return F.linear(x, w[3:], b[3:])
            return F.linear(x, w[1:], b[1:]).tanh()  # rows 1:6 contain the block's

    parent = Parent()
    block = _Functional(parent, parent.proj)
    recorder = StatisticsRecorder({"rows": block}, in_hook=True, grad_scaler=None,
                                  accumulation_steps=1, on_layer_done=lambda b: None,
                                  on_backward_end=lambda: None, timings={"factors": 0.0})
    recorder.recording = True
    x = torch.randn(7, 4)
    z = F.linear(x, parent.proj.weight[1:], parent.proj.bias[1:])
    z.retain_grad()
    z.tanh().sum().backward()
    parent.zero_grad()
    parent(x).sum().backward()
    a, g = block.stats.take()
    assert a is not None and g is not None and z.grad is not None
    torch.testing.assert_close(a[0], rows_a(x, bias=True), **TIGHT)
    torch.testing.assert_close(g[0], linear_g_batch(z.grad[:, 1:4])[0], **TIGHT)  # rows 2:5 of 1:6
    with pytest.warns(RuntimeWarning, match="rows 2:5 used in part"):
        parent(x, part=True).sum().backward()
    assert not block.stats.has_factors
    grad = block.gradient_matrix()
    assert grad is not None and grad.shape == (1, 3, 5)
    assert parent.proj.weight.grad is not None and parent.proj.bias.grad is not None
    torch.testing.assert_close(grad[0, :, :4], parent.proj.weight.grad[2:5], **TIGHT)
    block.write_grad(torch.zeros(1, 3, 5))
    assert not parent.proj.weight.grad[2:5].any() and parent.proj.weight.grad[5].any()
    recorder.remove()


def test_torch_func_transforms_over_a_hooked_model_record_nothing_and_do_not_crash() -> None:
    # issue #19: torch.func transforms over a hooked model crashed inside kaisa's hooks
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pre = kaisa.KFACPreconditioner(model, factor_update_steps=1)
    x = torch.randn(5, 4)
    params = dict(model.named_parameters())

    def loss(p: dict[str, torch.Tensor], xs: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (xs,)).square().sum()

    torch.func.grad(loss)(params, x)
    torch.func.jacrev(loss)(params, x)
    torch.func.vmap(torch.func.grad(lambda p, xi: loss(p, xi[None])), in_dims=(None, 0))(
        params, x)  # per-sample gradients
    torch.func.jvp(model, (x,), (torch.ones_like(x),))
    assert all(not b.stats.has_factors and not b.stats.saved_inputs for b in pre.layers.values())
    # the next real step records and preconditions as if no transform had run
    reference = copy.deepcopy(model)
    ref = kaisa.KFACPreconditioner(reference, factor_update_steps=1)
    for m, p in ((model, pre), (reference, ref)):
        m(x).square().sum().backward()
        p.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
