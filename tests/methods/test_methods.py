"""Unit tests of the second-order methods (kaisa.methods) against explicit math."""

from __future__ import annotations

import pytest
import torch

from kaisa.distributed import decomposition_numel
from kaisa.methods import METHODS, EigenMethod, InverseMethod, PiInverseMethod, make_method
from kaisa.utils.enums import ComputeMethod, Side
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


# ---------------------------------------------------------------------- diagonal sides
_SIDES = {"A": frozenset({Side.A}), "G": frozenset({Side.G}), "AG": frozenset({Side.A, Side.G})}


def _factor(blocks: int, n: int, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored, dense)``: the factor as a method gets it and as an explicit matrix."""
    if diagonal:
        d = torch.rand(blocks, n) + 0.05
        d[:, 0] = 0.0  # a token never seen: zero count
        return d, torch.diag_embed(d)
    f = _spd(blocks, n)
    return f, f


@pytest.mark.parametrize("sides", list(_SIDES))
@pytest.mark.parametrize("kind", ["eigen", "eigen_no_outer", "inverse", "pi_inverse"])
def test_diagonal_sides_are_the_dense_rule_on_diag_matrices(kind: str, sides: str) -> None:
    torch.manual_seed(3)
    diagonal = _SIDES[sides]
    method = (EigenMethod(outer_product=kind == "eigen") if kind.startswith("eigen")
              else make_method(ComputeMethod(kind)))
    damping, blocks, n_a, n_g = 0.03, 2, 6, 3
    a, a_dense = _factor(blocks, n_a, Side.A in diagonal)
    g, g_dense = _factor(blocks, n_g, Side.G in diagonal)
    grad = torch.randn(blocks, n_g, n_a)
    da, dg = method.factor_damping(a, g, damping, diagonal=diagonal)
    flags = [Side.A in diagonal, Side.G in diagonal]
    pa, pg = method.decompose([a, g], damping=[da, dg], inv_dtype=torch.float64,
                              names=["A", "G"], diagonal=flags)
    assert pa is not None and pg is not None
    for payload, n, flag in ((pa, n_a, flags[0]), (pg, n_g, flags[1])):
        assert [tuple(t.shape) for t in payload] == method.payload_shapes(blocks, n, diagonal=flag)
        assert len(method.payload_symmetric(diagonal=flag)) == len(payload)
        if flag:
            assert method.payload_symmetric(diagonal=True) == (False,) * len(payload)
    state: dict[str, torch.Tensor] = {}
    assert method.precondition(state, grad, damping, diagonal=diagonal) is None
    method.install(state, pa, pg, damping=damping, diagonal=diagonal)
    assert method.ready(state, diagonal=diagonal)
    assert method.stored(state, Side.A, diagonal=diagonal) == pa
    assert method.stored(state, Side.G, diagonal=diagonal) == pg
    shapes = method.state_shapes(blocks, n_a, n_g, diagonal=diagonal)
    stores_outer = getattr(method, "outer_product", False)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        k: v for k, v in shapes.items() if k != "dgda" or stores_outer}
    assert sum(t.numel() for t in state.values()) == blocks * method.numel(n_a, n_g,
                                                                           diagonal=diagonal)
    out = method.precondition(state, grad, damping, diagonal=diagonal)
    assert out is not None
    for k in range(blocks):
        if kind.startswith("eigen"):
            want = kron_solve(g_dense[k], a_dense[k], grad[k], damping)
        else:
            sa = sg = damping
            if kind == "pi_inverse":  # pi = sqrt((tr A / dim A) / (tr G / dim G))
                pi = ((torch.trace(a_dense[k]) / n_a) / (torch.trace(g_dense[k]) / n_g)).sqrt()
                sa, sg = pi * damping**0.5, damping**0.5 / pi
            a_inv = torch.linalg.inv(a_dense[k] + sa * torch.eye(n_a))
            g_inv = torch.linalg.inv(g_dense[k] + sg * torch.eye(n_g))
            want = g_inv @ grad[k] @ a_inv
        torch.testing.assert_close(out[k], want, rtol=1e-10, atol=1e-12)


def test_a_diagonal_and_a_dense_factor_decompose_in_one_call() -> None:
    torch.manual_seed(4)
    method = EigenMethod()
    d = torch.tensor([[-1e-18, 0.5, 2.0]])  # a rounding below zero is clamped
    dense = _spd(1, 4)
    pd, pf = method.decompose([d, dense], damping=[0.1, 0.1], inv_dtype=torch.float32,
                              names=["d", "f"], diagonal=[True, False])
    assert pd is not None and pf is not None
    assert len(pd) == 1 and pd[0].dtype == torch.float32
    assert torch.equal(pd[0], torch.tensor([[0.0, 0.5, 2.0]], dtype=torch.float32))
    assert [tuple(t.shape) for t in pf] == [(1, 4, 4), (1, 4)]
    assert method.decompose_flops(1000, diagonal=True) == 1000.0
    assert method.required_keys(diagonal=frozenset({Side.A})) == ("da", "qg", "dg")


def test_a_non_finite_diagonal_result_is_a_failure() -> None:
    method = InverseMethod()
    zero = torch.zeros(1, 3)
    (res,) = method.decompose([zero], damping=[0.0], inv_dtype=torch.float64, names=["A"],
                              diagonal=[True])
    assert res is None  # 1 / (0 + 0): keep the previous result
    (ok,) = method.decompose([zero], damping=[0.5], inv_dtype=torch.float64, names=["A"],
                             diagonal=[True])
    assert ok is not None and torch.equal(ok[0], torch.full((1, 3), 2.0))
