"""Each product as a DCP ``Stateful`` in the user's own ``dcp.save``/``dcp.load`` dict.

On 2 gloo ranks (MEM-OPT: each rank holds its own decompositions; EKFAC's row generator
seeded per rank; KFACMuon in both curvature modes) every product is trained ``K`` steps, saved with ``dcp.save`` in a dict
composed as torchtitan composes one (``'model'``, ``'optim'`` and the K-FAC state as
:class:`kaisa.checkpoint.KFACStateful`), and trained ``M`` more (the reference). Fresh
objects (other initial weights) load the checkpoint with ``dcp.load`` and train the same
``M`` steps: the parameters are bit-equal (``torch.equal``) on every rank. A checkpoint of
one product is refused by another's ``KFACStateful`` with a ``ValueError``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

import kaisa
from kaisa.checkpoint import KFACStateful
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed

PRODUCTS = ("preconditioner", "ekfac", "kfac", "kfac_muon_input", "kfac_muon_eigen")
K, M = 2, 3  # decompositions every 3 steps: the steps after loading use the saved ones
BATCH = 8


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 4)).double()


def _build(product: str, seed: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer,
                                               kaisa.KFACPreconditioner | None]:
    """The model, what the steps run (DDP, but not for KFAC), the optimizer, the preconditioner."""
    model = _model(seed)
    if product == "kfac":  # every rank the same data: no gradients to average
        opt: torch.optim.Optimizer = kaisa.KFAC(
            model, loss="cross_entropy", curvature="mc", seed=7, damping=0.01,
            damping_interval=2, inv_update_steps=3, inv_dtype=torch.float64,
            grad_worker_fraction="mem_opt")
        return model, model, opt, None
    net = DistributedDataParallel(model)
    if product == "ekfac":
        opt = kaisa.EKFAC(model, lr=1e-2, eps=1e-6, weight_decay=0.1, basis_update_steps=3,
                          basis_refresh="qr", grad_worker_fraction="mem_opt", factor_rows=5)
        return model, net, opt, None
    if product.startswith("kfac_muon_"):
        opt = kaisa.KFACMuon(model, lr=0.05, curvature=product.removeprefix("kfac_muon_"),
                             refresh_steps=3, basis_refresh="qr", factor_rows=5,
                             grad_worker_fraction="mem_opt")
        return model, net, opt, None
    pre = kaisa.KFACPreconditioner(model, grad_worker_fraction="mem_opt", inv_update_steps=3,
                                   inv_dtype=torch.float64, damping=0.01, lr=0.1)
    return model, net, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), pre


def _step(product: str, net: nn.Module, opt: torch.optim.Optimizer,
          pre: kaisa.KFACPreconditioner | None, step: int, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + (0 if product == "kfac" else rank))
    x = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (BATCH,), generator=gen)
    if product == "kfac":
        opt.step(lambda: (net(x), y))
        return
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(net(x), y).backward()
    if pre is not None:
        pre.step()
    opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer,
           pre: kaisa.KFACPreconditioner | None) -> dict[str, Any]:
    """The user's DCP dict: EKFAC, KFAC and KFACMuon are the optimizer, its entry."""
    if pre is None:
        return {"model": get_model_state_dict(model), "optim": KFACStateful(product=opt)}
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt), "kfac": KFACStateful(product=pre)}


def _job(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    out: dict[str, Any] = {}
    for product in PRODUCTS:
        path = os.path.join(root, product)
        model, net, opt, pre = _build(product, seed=0)
        for step in range(K):
            _step(product, net, opt, pre, step, rank)
        dcp.save(_state(model, opt, pre), checkpoint_id=path)
        for step in range(K, K + M):
            _step(product, net, opt, pre, step, rank)
        reference = [p.detach().clone() for p in model.parameters()]
        model, net, opt, pre = _build(product, seed=1)
        state = _state(model, opt, pre)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        if pre is not None:
            set_optimizer_state_dict(model, opt, state["optim"])
        for step in range(K, K + M):
            _step(product, net, opt, pre, step, rank)
        out[product] = (reference, [p.detach().clone() for p in model.parameters()])
    # Another product's checkpoint: refused, naming both.
    model, _, opt, _ = _build("ekfac", seed=0)
    before = opt.state_dict()["kaisa"]["steps"]
    try:
        dcp.load({"kfac": KFACStateful(product=opt)},
                 checkpoint_id=os.path.join(root, "preconditioner"))
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    out["unchanged"] = opt.state_dict()["kaisa"]["steps"] == before
    return out


@pytest.mark.timeout(240)
def test_every_product_resumes_bit_exactly_from_a_users_dcp_dict(tmp_path: Path) -> None:
    results = run_distributed(_job, 2, str(tmp_path), timeout=220.0)
    for rank, got in enumerate(results):
        for product in PRODUCTS:
            reference, resumed = got[product]
            for want, have in zip(reference, resumed, strict=True):
                assert torch.equal(want, have), (product, rank)
        assert "KFACPreconditioner" in got["refused"] and "EKFAC" in got["refused"], got
        assert got["unchanged"]
