"""Unit tests of the second-order methods (kaisa.methods) against explicit math."""

from __future__ import annotations

import pytest
import torch

from kaisa.distributed import decomposition_numel
from kaisa.enums import ComputeMethod, Side
from kaisa.methods import METHODS, EigenMethod, InverseMethod, PiInverseMethod, make_method
from tests.support.explicit import kron_solve

pytestmark = pytest.mark.usefixtures("float64")


def _spd(blocks: int, n: int) -> torch.Tensor:
    x = torch.randn(blocks, n, n + 2)
    return x @ x.mT / n + 0.05 * torch.eye(n)


@pytest.mark.parametrize("outer_product", [True, False])
def test_eigen_method_is_the_damped_kronecker_solve(outer_product: bool) -> None:
    torch.manual_seed(0)
    method = EigenMethod(outer_product=outer_product)
    a, g, grad = _spd(2, 5), _spd(2, 3), torch.randn(2, 3, 5)
    pa, pg = method.decompose([a, g], damping=[0.1, 0.1], inv_dtype=torch.float64, names=["A", "G"])
    assert pa is not None and pg is not None
    assert [tuple(t.shape) for t in pa] == method.payload_shapes(2, 5)
    state: dict[str, torch.Tensor] = {}
    assert method.precondition(state, grad, 0.1) is None and not method.ready(state)
    method.install(state, pa, pg, damping=0.1)
    assert ("dgda" in state) == outer_product
    assert method.stored(state, Side.A) == pa and method.stored(state, Side.G) == pg
    out = method.precondition(state, grad, 0.1)
    assert out is not None
    for k in range(2):
        torch.testing.assert_close(out[k], kron_solve(g[k], a[k], grad[k], 0.1))


def test_inverse_method_uses_damped_inverses() -> None:
    torch.manual_seed(1)
    method = InverseMethod()
    a, g, grad = _spd(1, 4), _spd(1, 6), torch.randn(1, 6, 4)
    pa, pg = method.decompose([a, g], damping=[0.2, 0.2], inv_dtype=torch.float64, names=["A", "G"])
    state: dict[str, torch.Tensor] = {}
    method.install(state, pa, None, damping=0.2)
    assert not method.ready(state)  # G missing
    method.install(state, None, pg, damping=0.2)
    out = method.precondition(state, grad, 0.2)
    eye_a, eye_g = torch.eye(4), torch.eye(6)
    want = torch.linalg.inv(g[0] + 0.2 * eye_g) @ grad[0] @ torch.linalg.inv(a[0] + 0.2 * eye_a)
    assert out is not None
    torch.testing.assert_close(out[0], want)
    assert method.symmetric == (True,) and method.state_keys == ("a_inv", "g_inv")


def test_pi_inverse_is_factored_tikhonov_damping() -> None:
    torch.manual_seed(2)
    method = PiInverseMethod()
    a, g, grad = 3.0 * _spd(2, 4), 0.01 * _spd(2, 5), torch.randn(2, 5, 4)
    damping = 0.02
    da, dg = method.factor_damping(a, g, damping)
    assert isinstance(da, torch.Tensor) and isinstance(dg, torch.Tensor)
    pa, pg = method.decompose([a, g], damping=[da, dg], inv_dtype=torch.float64, names=["A", "G"])
    state: dict[str, torch.Tensor] = {}
    method.install(state, pa, pg, damping=damping)
    out = method.precondition(state, grad, damping)
    assert out is not None
    for k in range(2):
        pi = ((torch.trace(a[k]) / 4) / (torch.trace(g[k]) / 5)).sqrt()
        eye_a, eye_g = torch.eye(4), torch.eye(5)
        a_inv = torch.linalg.inv(a[k] + pi * damping**0.5 * eye_a)
        g_inv = torch.linalg.inv(g[k] + damping**0.5 / pi * eye_g)
        torch.testing.assert_close(out[k], g_inv @ grad[k] @ a_inv)
        # the product of the damped factors is A (x) G + damping I plus the cross terms
        kron = torch.kron(g[k] + damping**0.5 / pi * eye_g, a[k] + pi * damping**0.5 * eye_a)
        cross = torch.kron(g[k], eye_a) * pi * damping**0.5 + torch.kron(eye_g, a[k]) * (
            damping**0.5 / pi
        )
        torch.testing.assert_close(kron, torch.kron(g[k], a[k]) + damping * torch.eye(20) + cross)
    assert method.symmetric == (True,)


def test_pi_inverse_falls_back_to_pi_one() -> None:
    method = PiInverseMethod()
    a = torch.zeros(2, 3, 3)
    a[1] = torch.eye(3)
    g = torch.eye(2).expand(2, 2, 2).clone()
    g[1] = float("nan")
    da, dg = method.factor_damping(a, g, 0.04)
    torch.testing.assert_close(da, torch.tensor([0.2, 0.2], dtype=torch.float64))
    torch.testing.assert_close(dg, torch.tensor([0.2, 0.2], dtype=torch.float64))


def test_install_none_keeps_the_previous_result() -> None:
    method = EigenMethod()
    state: dict[str, torch.Tensor] = {}
    pa = [torch.eye(3).unsqueeze(0), torch.ones(1, 3)]
    pg = [torch.eye(2).unsqueeze(0), 2 * torch.ones(1, 2)]
    method.install(state, pa, pg, damping=1.0)
    before = {k: v.clone() for k, v in state.items()}
    method.install(state, None, None, damping=1.0)
    assert all(torch.equal(state[k], before[k]) for k in before)
    torch.testing.assert_close(state["dgda"], torch.full((1, 2, 3), 1 / 3))


@pytest.mark.parametrize("kind", list(ComputeMethod))
def test_memory_model_is_the_method_numel(kind: ComputeMethod) -> None:
    assert kind in METHODS
    method = make_method(kind)
    assert decomposition_numel(7, 3, kind) == method.numel(7, 3)
    assert decomposition_numel(7, 3, kind.value) == method.numel(7, 3)
    n_a, n_g = 7, 3
    state: dict[str, torch.Tensor] = {}
    a, g = _spd(1, n_a), _spd(1, n_g)
    pa, pg = method.decompose([a, g], damping=[0.1, 0.1], inv_dtype=torch.float64, names=["A", "G"])
    method.install(state, pa, pg, damping=0.1)
    assert sum(t.numel() for t in state.values()) == method.numel(n_a, n_g)
