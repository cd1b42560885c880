"""One-sided bases (``kaisa.EKFAC(max_basis_dim=n)``), in float64.

docs/conventions.md, "One-sided bases": a side of a Linear or attention block whose
dimension exceeds ``n`` is kept as the diagonal of its factor (computed without the dense
factor, over the same rows), and its basis is the identity: EKFAC rotates the other side.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.blocks import LinearBlock, register_blocks
from kaisa.utils.enums import KFACApprox, Side

pytestmark = pytest.mark.usefixtures("float64")


class Net(nn.Module):
    """``fc1`` 3 -> 9 (A 4 dense, G 9), ``fc2`` 9 -> 2 without bias (A 9, G 2), an MHA."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 9)
        self.fc2 = nn.Linear(9, 2, bias=False)
        self.attn = nn.MultiheadAttention(2, 1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.attn(h, h, h, need_weights=False)[0]


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(70 + step)
    return torch.randn(2, 5, 3, generator=gen), torch.randn(2, 5, 2, generator=gen)


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# --------------------------------------------------------------------------- the estimator


@pytest.mark.parametrize("approx", [KFACApprox.EXPAND, KFACApprox.REDUCE])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("scale", [1.0, 8.0, torch.tensor(4.0)])
def test_diagonal_side_is_the_dense_factors_diagonal(
    approx: KFACApprox, bias: bool, scale: float | torch.Tensor
) -> None:
    torch.manual_seed(1)
    layer = nn.Linear(4, 6, bias=bias)
    dense = register_blocks(nn.Sequential(layer), kfac_approx=approx)["0"]
    one = register_blocks(nn.Sequential(layer), kfac_approx=approx, max_dense_dim=3)["0"]
    assert isinstance(one, LinearBlock) and one.diagonal_sides == {Side.A, Side.G}
    gen = torch.Generator().manual_seed(2)
    x, d = torch.randn(3, 7, 4, generator=gen), torch.randn(3, 7, 6, generator=gen)
    a, g = one.compute_a_batch(x), one.compute_g_batch(d, scale)
    assert a.shape == (1, 4 + bias) and g.shape == (1, 6)
    torch.testing.assert_close(a, dense.compute_a_batch(x).diagonal(dim1=1, dim2=2),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(g, dense.compute_g_batch(d, scale).diagonal(dim1=1, dim2=2),
                               rtol=1e-14, atol=0)
    # explicitly: column means of the squared rows (expand: every position is a row)
    if approx is KFACApprox.EXPAND:
        rows = x.reshape(-1, 4)
        want = torch.cat([rows.square().mean(0), torch.ones(int(bias))])
        torch.testing.assert_close(a[0], want, rtol=1e-14, atol=0)


def test_sides_above_the_limit_only_are_diagonal() -> None:
    model = _net()
    blocks = register_blocks(model, max_dense_dim=4)
    sides = {n: (b.dims, set(b.diagonal_sides)) for n, b in blocks.items()}
    assert sides == {
        "fc1": ((4, 9), {Side.G}),  # 3 inputs + bias = 4: not above the limit
        "fc2": ((9, 2), {Side.A}),
        "attn.in_proj": ((3, 6), {Side.G}),
        "attn.out_proj": ((3, 2), set()),
    }
    assert all(not b.diagonal_sides for b in register_blocks(model).values())


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "8"])
def test_bad_limit_raises(value: Any) -> None:
    with pytest.raises(ValueError, match="max_basis_dim must be None or an integer >= 1"):
        kaisa.EKFAC(_net(), max_basis_dim=value)


# --------------------------------------------------------------------------- EKFAC


def test_running_factors_are_the_dense_runs_diagonals() -> None:
    """With ``lr = 0`` both runs see the same activations: each diagonal running factor is
    the dense run's diagonal, each dense one the dense run's factor."""
    model, twin = _net(), _net()
    one = kaisa.EKFAC(model, lr=0.0, max_basis_dim=4, basis_update_steps=2)
    dense = kaisa.EKFAC(twin, lr=0.0, basis_update_steps=2)
    for step in range(4):
        _train(model, one, step)
        _train(twin, dense, step)
    for name, block in one.curvature.blocks.items():
        ref = dense.curvature.blocks[name]
        for side, got, want in ((Side.A, block.a, ref.a), (Side.G, block.g, ref.g)):
            assert got is not None and want is not None
            if block.is_diagonal(side):
                want = want.diagonal(dim1=-2, dim2=-1)
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


def test_the_step_is_adam_on_the_one_side_rotated_gradient() -> None:
    """After a refresh, the dense side's basis diagonalises its factor, the diagonal side
    has none, and the step is ``-lr QG adam(QG^T g)`` (``G`` dense) or
    ``-lr adam(g QA) QA^T`` (``A`` dense) with Adam's moments in that basis."""
    lr, (b1, b2), eps = 1e-2, (0.9, 0.95), 1e-8
    model = _net()
    opt = kaisa.EKFAC(model, lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0,
                      max_basis_dim=4, basis_update_steps=100)
    _train(model, opt, 0)  # step 0 refreshes the bases, then no refresh until step 100
    blocks = {"fc1": opt.curvature.blocks["fc1"], "fc2": opt.curvature.blocks["fc2"]}
    bases = {}
    for name, block in blocks.items():
        state = block.decomposition
        dense_side = Side.A if name == "fc1" else Side.G
        q = state["qa" if dense_side is Side.A else "qg"][0]
        factor = (block.a if dense_side is Side.A else block.g)[0]  # type: ignore[index]
        torch.testing.assert_close(q.T @ factor @ q, torch.diag(torch.diagonal(q.T @ factor @ q)),
                                   rtol=0, atol=1e-12)
        assert state.get("qg" if dense_side is Side.A else "qa") is None
        bases[name] = (dense_side, q, state["exp_avg"][0].clone(), state["exp_avg_sq"][0].clone())
    before = {n: b.weight.detach().clone() for n, b in blocks.items()}
    x, y = _batch(1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    grads = {"fc1": torch.cat([model.fc1.weight.grad, model.fc1.bias.grad[:, None]], dim=1),
             "fc2": model.fc2.weight.grad.clone()}
    opt.step()
    for name, (side, q, m, v) in bases.items():
        r = grads[name] @ q if side is Side.A else q.T @ grads[name]
        m = b1 * m + (1 - b1) * r
        v = b2 * v + (1 - b2) * r * r
        adam = (m / (1 - b1**2)) / ((v / (1 - b2**2)).sqrt() + eps)
        update = adam @ q.T if side is Side.A else q @ adam
        weight = blocks[name].weight
        torch.testing.assert_close(weight, before[name] - lr * update[:, : weight.shape[1]],
                                   rtol=1e-12, atol=1e-14)


def test_state_dict_round_trip_resumes_bit_exactly() -> None:
    kw = dict(lr=2e-2, max_basis_dim=4, basis_update_steps=3, factor_rows=4)
    model = _net()
    opt = kaisa.EKFAC(model, **kw)
    for step in range(4):
        _train(model, opt, step)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(4, 8):
        _train(model, opt, step)
    resumed = Net()
    again = kaisa.EKFAC(resumed, **kw)
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    for step in range(4, 8):
        _train(resumed, again, step)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
    dense = kaisa.EKFAC(_net(), lr=2e-2, basis_update_steps=3, factor_rows=4)
    untouched = copy.deepcopy(dense.state_dict())
    with pytest.raises(ValueError):
        dense.load_state_dict(saved[1])
    assert str(dense.state_dict()) == str(untouched)
