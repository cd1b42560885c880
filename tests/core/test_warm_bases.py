"""Warm-started eigenbases for the eigen method (``basis_refresh='qr'``), float64.

``docs/conventions.md``, "Warm-started eigenbases": decomposition step
``k = steps // inv_update_steps`` is a full ``eigh`` when ``k % eigh_every == 0``, else
each dense factor's basis is one subspace-iteration step from the stored one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.core.schedule import warm_refresh
from kaisa.utils.enums import BasisRefresh


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _warm(factor: torch.Tensor, q0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The conventions' warm start, written out."""
    p = factor @ q0
    e = (q0 * p).sum(dim=-2)
    order = torch.argsort(e, dim=-1, descending=True, stable=True)
    q, r = torch.linalg.qr(torch.take_along_dim(p, order.unsqueeze(-2), dim=-1))
    signs = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(q.dtype)
    q = (q * signs.unsqueeze(-2)).flip(-1)
    return q, torch.take_along_dim(e, order, dim=-1).flip(-1).clamp(min=0.0)


def test_which_decomposition_steps_are_warm() -> None:
    pattern = [False, True, True, False, True, True, False]
    for cuda in (False, True):
        assert [warm_refresh(k, BasisRefresh.QR, 3, cuda=cuda) for k in range(7)] == pattern
        assert not any(warm_refresh(k, BasisRefresh.EIGH, 3, cuda=cuda) for k in range(7))
    # 'auto': QR's on a CUDA device, eigh's elsewhere
    assert [warm_refresh(k, BasisRefresh.AUTO, 3, cuda=True) for k in range(7)] == pattern
    assert not any(warm_refresh(k, BasisRefresh.AUTO, 3, cuda=False) for k in range(7))


@pytest.mark.parametrize("outer_product", [True, False])
def test_warm_steps_follow_the_stored_bases_and_every_third_is_a_full_eigh(
    outer_product: bool,
) -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = kaisa.KFACPreconditioner(model, inv_update_steps=2, basis_refresh="qr", eigh_every=3,
                                   inv_dtype=torch.float64, damping=0.01,
                                   compute_eigenvalue_outer_product=outer_product)
    gen = torch.Generator().manual_seed(1)
    stored: dict[str, dict[str, torch.Tensor]] = {}
    warm_seen = full_seen = 0
    for step in range(9):
        x = torch.randn(16, 5, generator=gen, dtype=torch.float64)
        y = torch.randn(16, 3, generator=gen, dtype=torch.float64)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        pre.step()
        sgd.step()
        for name, block in pre.curvature.blocks.items():
            d = block.decomposition
            if step % 2 == 0:  # a decomposition step
                for side, factor in (("a", block.a), ("g", block.g)):
                    assert factor is not None
                    if (step // 2) % 3 == 0:
                        want_d = torch.linalg.eigvalsh(factor).clamp(min=0.0)
                        torch.testing.assert_close(d[f"d{side}"], want_d, rtol=1e-10,
                                                   atol=1e-13)
                        full_seen += 1
                    else:
                        want_q, want_d = _warm(factor, stored[name][f"q{side}"])
                        torch.testing.assert_close(d[f"q{side}"], want_q, rtol=1e-12,
                                                   atol=1e-13)
                        torch.testing.assert_close(d[f"d{side}"], want_d, rtol=1e-12,
                                                   atol=1e-13)
                        warm_seen += 1
                if outer_product:
                    want = 1.0 / (torch.outer(d["dg"][0], d["da"][0]) + 0.01)
                    torch.testing.assert_close(d["dgda"][0], want, rtol=1e-12, atol=0.0)
            stored[name] = {k: v.clone() for k, v in d.items()}
    assert warm_seen == 3 * 2 * 2 and full_seen == 2 * 2 * 2  # steps 2, 4, 8 / 0, 6


def test_qr_with_eigh_every_one_is_the_eigh_run_bit_for_bit() -> None:
    results = []
    for kwargs in ({}, {"basis_refresh": "qr", "eigh_every": 1}):
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        pre = kaisa.KFACPreconditioner(model, inv_update_steps=2, **kwargs)
        gen = torch.Generator().manual_seed(2)
        for _ in range(6):
            x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
            model.zero_grad()
            F.mse_loss(model(x), x[:, :3]).backward()
            pre.step()
            sgd.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("kwargs", [
    {"basis_refresh": "qr", "compute_method": "inverse"},
    {"basis_refresh": "qr", "compute_method": "pi_inverse"},
    {"basis_refresh": "svd"},
    {"eigh_every": 0},
    {"eigh_every": 2.0},
])
def test_bad_refresh_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"basis_refresh|eigh_every"):
        kaisa.KFACPreconditioner(_model(), **kwargs)


def test_ekfac_keeps_its_refresh_settings() -> None:
    opt = kaisa.EKFAC(_model(), basis_refresh="qr", eigh_every=4)
    assert opt.config.basis_refresh is BasisRefresh.QR and opt.config.eigh_every == 4
    assert opt.config.kfac.basis_refresh is BasisRefresh.QR
    assert kaisa.EKFAC(_model()).config.basis_refresh is BasisRefresh.EIGH  # the default


def test_auto_is_eigh_on_the_cpu_bit_for_bit() -> None:
    """'auto' (any method) decomposes in full off CUDA devices."""
    def run(product: str, refresh: str) -> list[torch.Tensor]:
        model = _model()
        if product == "ekfac":
            opt: Any = kaisa.EKFAC(model, lr=0.01, basis_update_steps=2, basis_refresh=refresh)
            step = opt.step
        else:
            sgd = torch.optim.SGD(model.parameters(), lr=0.05)
            pre = kaisa.KFACPreconditioner(model, inv_update_steps=2, basis_refresh=refresh,
                                           eigh_every=3, compute_method=product)

            def step() -> None:
                pre.step()
                sgd.step()
        gen = torch.Generator().manual_seed(4)
        for _ in range(7):
            x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
            model.zero_grad()
            F.mse_loss(model(x), x[:, :3]).backward()
            step()
        return [p.detach().clone() for p in model.parameters()]

    for product in ("ekfac", "eigen", "inverse"):
        got, want = run(product, "auto"), run(product, "eigh")
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), product
