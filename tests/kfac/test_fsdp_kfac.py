"""``kaisa.KFAC`` on a model sharded by FSDP2 (``fully_shard``): gloo ranks equal one process.

The setting of ``tests/distributed/test_fsdp.py`` (float64, ``fully_shard`` on each layer and on the
root, uneven shards; the reference is the unsharded model in one process on the global
batch) for the adaptive optimizer: the loss is a mean over each rank's share and FSDP2
averages the gradients, which is the global batch's gradient; the Monte-Carlo targets
are each rank's share of the one process's draw (``kaisa.kfac.losses.Share``). What FSDP2
changes and every step checks: the preconditioned direction and the velocity are
``DTensor`` objects with each rank's rows; the quadratic model's dot products sum the
shards over ranks, once per shard on an HSDP mesh (:func:`kaisa.kfac.quadratic.gram`); its
``J v`` replays the forward pass with dual parameters installed inside each unit
(:mod:`kaisa.distributed.fsdp_tangents`), which gathers one unit's tangents at a time; and after a
replay every unit is sharded again (otherwise the next forward would read stale
parameters). The chosen lr, momentum and damping of every step and the parameters must
equal the one process's (``rtol=1e-8``, as the other distributed tests; a shard counted
twice, a missing tangent or a stale parameter moves them by far more), and be
bit-identical on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import kaisa
from tests.distributed.test_distributed_transformer import _batch
from tests.distributed.test_fsdp import _data, _full, build_model
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 4
PER_RANK = 4
RTOL, ATOL = 1e-8, 1e-10


def _train(cfg: dict[str, Any], world: int, rank: int | None,
           mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """STEPS of adaptive KFAC; ``rank=None`` is the unsharded single-process reference."""
    gpt = cfg.get("model") == "gpt"
    model = build_model(gpt, sharded=rank is not None, mesh_shape=mesh_shape,
                        reshard_after_forward=cfg.get("reshard", True))
    opt = kaisa.KFAC(
        model, loss="cross_entropy", curvature=cfg["curvature"], seed=7, damping=0.01,
        damping_interval=2, inv_update_steps=2, inv_dtype=torch.float64,
        grad_worker_fraction=cfg["strategy"], layer_kinds="all" if gpt else ("linear", "conv2d"),
        weight_decay=cfg.get("weight_decay", 0.0),
    )
    steps, last = [[_full(p) for p in model.parameters()]], []
    for step in range(STEPS):
        if gpt:
            x, y = _batch(world, step, rank)
        else:
            x, y = _data(world, step, PER_RANK)
            if rank is not None:
                x, y = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in (x, y))
        opt.step(lambda x=x, y=y: (model(x), y))
        steps.append([_full(p) for p in model.parameters()])
        last.append({k: opt.last[k] for k in ("lr", "momentum", "damping", "loss")})
    params = list(model.parameters())
    return {
        "steps": steps, "last": last,
        # after a step the model's parameters are the sharded ones again, and so is the state
        "sharded": rank is None or all(isinstance(p, DTensor) for p in params),
        "velocity": rank is None or all(isinstance(opt.state[p]["velocity"], DTensor)
                                        for p in params if "velocity" in opt.state[p]),
        "first_order": sorted(n for n, kind in opt.coverage().items() if kind == "first-order"),
    }


def _ranks(rank: int, world: int, cfgs: list[dict[str, Any]],
           mesh_shape: tuple[int, ...] | None) -> list[dict[str, Any]]:
    torch.set_default_dtype(torch.float64)
    return [_train(cfg, world, rank, mesh_shape) for cfg in cfgs]


def _check(cfgs: list[dict[str, Any]], world: int,
           mesh_shape: tuple[int, ...] | None = None) -> None:
    results = run_distributed(_ranks, world, cfgs, mesh_shape, timeout=280.0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        refs = [_train(cfg, world, None) for cfg in cfgs]
    finally:
        torch.set_default_dtype(old)
    for i, (cfg, ref) in enumerate(zip(cfgs, refs, strict=True)):
        # the reference takes real steps: an adaptive lr; on the small net, momentum too
        # (the GPT's 4-rank batch happens to choose none: its velocity is then zero)
        assert all(s["lr"] > 0 for s in ref["last"]), (cfg, ref["last"])
        assert cfg.get("model") == "gpt" or any(s["momentum"] != 0 for s in ref["last"]), (
            cfg, ref["last"])
        for rank_results in results:
            got = rank_results[i]
            assert got["sharded"] and got["velocity"], cfg
            assert got["first_order"] == ref["first_order"], cfg
            for step, (have, want) in enumerate(zip(got["last"], ref["last"], strict=True)):
                for key in have:
                    assert have[key] == pytest.approx(want[key], rel=RTOL, abs=ATOL), (
                        cfg, step, key, have, want)
            for step, (want, have) in enumerate(zip(ref["steps"], got["steps"], strict=True)):
                for w, h in zip(want, have, strict=True):
                    torch.testing.assert_close(h, w, rtol=RTOL, atol=ATOL,
                                               msg=f"{cfg} step {step}")
        for other in results[1:]:  # bit-identical parameters on every rank
            for a, b in zip(results[0][i]["steps"][-1], other[i]["steps"][-1], strict=True):
                assert torch.equal(a, b), cfg


def test_kfac_fsdp2_two_ranks_equal_one_process() -> None:
    """Both strategies, the three curvatures, weight decay, units that stay unsharded
    after the forward pass (``reshard_after_forward=False``); the byte GPT with every block
    kind (attention's row blocks, the tied embedding and head, LayerNorms) and its
    first-order parameters (AdamW on their shards)."""
    _check([{"curvature": "mc", "strategy": "mem_opt"},
            {"curvature": "empirical", "strategy": "comm_opt", "weight_decay": 1e-3},
            {"curvature": "type2", "strategy": "mem_opt"},
            {"curvature": "mc", "strategy": "mem_opt", "reshard": False},
            {"curvature": "mc", "strategy": "mem_opt", "model": "gpt"}], 2)


def test_kfac_hsdp_2x2_equals_one_process() -> None:
    """A 2-D mesh (replicate x shard): each shard's products counted once, not twice."""
    _check([{"curvature": "mc", "strategy": "hybrid_opt"}], 4, (2, 2))


@pytest.mark.slow
def test_kfac_fsdp2_four_ranks_equal_one_process() -> None:
    _check([{"curvature": "mc", "strategy": "hybrid_opt"},
            {"curvature": "mc", "strategy": "mem_opt", "model": "gpt"}], 4)


def _fixed_mode(rank: int, world: int) -> dict[str, list[list[torch.Tensor]]]:
    """Fixed lr and momentum, empirical curvature, KL clip: under DDP and under FSDP2."""
    torch.set_default_dtype(torch.float64)
    out = {}
    for wrap in ("ddp", "fsdp2"):
        model = build_model(False, sharded=wrap == "fsdp2", mesh_shape=None)
        net: nn.Module = DistributedDataParallel(model) if wrap == "ddp" else model
        opt = kaisa.KFAC(model, loss="cross_entropy", curvature="empirical", lr=0.1,
                         momentum=0.9, kl_clip=1e-5, damping=0.01, inv_update_steps=2,
                         inv_dtype=torch.float64, grad_worker_fraction="mem_opt",
                         layer_kinds=("linear", "conv2d"))
        steps = []
        for step in range(STEPS):
            x, y = _data(world, step, PER_RANK)
            x, y = (t[rank * PER_RANK : (rank + 1) * PER_RANK] for t in (x, y))
            opt.step(lambda x=x, y=y, net=net: (net(x), y))
            steps.append([_full(p) for p in model.parameters()])
        out[wrap] = steps
    return out


def test_kfac_fixed_lr_under_fsdp2_equals_ddp() -> None:
    """The fixed mode (``lr``/``momentum`` numbers, the preconditioned gradients written into
    the sharded ``.grad`` with a KL clip that binds, then the SGD update of the shards). Its empirical
    G keeps kfac-pytorch's convention (each rank's output gradients of its own mean loss,
    ``docs/conventions.md``), so the reference is DDP on the same ranks, not one process."""
    results = run_distributed(_fixed_mode, 2, timeout=120.0)
    for got in results:
        moved = [float((b - a).abs().max()) for a, b in zip(got["ddp"][0], got["ddp"][-1],
                                                              strict=True)]
        assert min(moved) > 1e-5, moved
        for step, (want, have) in enumerate(zip(got["ddp"], got["fsdp2"], strict=True)):
            for w, h in zip(want, have, strict=True):
                torch.testing.assert_close(h, w, rtol=RTOL, atol=ATOL, msg=f"step {step}")
