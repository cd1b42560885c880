"""kaisa.KFACMuon on 2 and 4 gloo ranks, every strategy, equals one process (float64).

The tiny float64 GPT of ``tests/distributed/test_distributed_transformer.py`` under
DistributedDataParallel, each rank holding its windows of the global batch; the parent
trains the same model on the whole batch. The Newton-Schulz iteration runs in float64
(``ns_dtype``). Every rank must hold bit-identical parameters; each block's state
(``M`` and the momentum buffer, or the bases and moments) lives on its gradient workers
only (one rank per block under MEM-OPT). ``'eigen'``'s G factors on ``W`` ranks are ``W^2``
times the single process's (a mean loss over ``1/W`` of the rows), which moves no
eigenvector. Tolerance 1e-12 absolute (the runs differ in the order of sums only), with
``'eigen'``'s Adam ``eps`` 1e-3; one more ``'eigen'`` run with ``eps`` 1e-6, where Adam's
``r / (|r| + eps)`` on coordinates near ``eps`` amplifies those differences, to 1e-8
relative, as EKFAC's test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import kaisa
from tests.distributed.test_distributed_transformer import VOCAB, _batch, _gpt, _snapshot
from tests.support.dist import run_distributed

STEPS = 5
#: (rtol, atol) by Adam's eps (the input mode has none: 1e-3 stands for it).
TOLERANCE = {1e-3: (0.0, 1e-12), 1e-6: (1e-8, 1e-10)}


def _train(cfg: dict[str, Any], world: int, rank: int | None) -> dict[str, Any]:
    model = _gpt()
    net = DistributedDataParallel(model) if rank is not None else model
    opt = kaisa.KFACMuon(model, lr=0.05, weight_decay=0.1, curvature=cfg["mode"],
                         refresh_steps=2, basis_refresh="eigh", adam_eps=cfg["eps"],
                         ns_dtype=torch.float64, grad_worker_fraction=cfg["strategy"])
    steps = [_snapshot(model)]
    for step in range(STEPS):
        tokens, targets = _batch(world, step, rank)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(tokens).reshape(-1, VOCAB), targets.reshape(-1)).backward()
        opt.step()
        steps.append(_snapshot(model))
    key = "momentum_buffer" if cfg["mode"] == "input" else "exp_avg"
    held = sorted(n for n, b in opt.curvature.blocks.items() if key in b.decomposition)
    return {"steps": steps, "held": held, "fraction": float(opt.curvature.engine.grid.fraction)}


def _job(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    torch.set_default_dtype(torch.float64)
    return [_train(cfg, world, rank) for cfg in configs]


def _reference(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _train(cfg, world, None)
    finally:
        torch.set_default_dtype(old)


CONFIGS = {
    2: [*(dict(mode=m, strategy=s, eps=1e-3) for m in ("input", "eigen")
          for s in ("comm_opt", "mem_opt", "hybrid_opt")),
        dict(mode="eigen", strategy="hybrid_opt", eps=1e-6)],
    4: [dict(mode=m, strategy="hybrid_opt", eps=1e-3) for m in ("input", "eigen")],
}


@pytest.mark.filterwarnings("ignore:.*the hooks of registered layer")
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_kfac_muon_on_ranks_equals_one_process(world: int) -> None:
    configs = CONFIGS[world]
    results = run_distributed(_job, world, configs, timeout=280)
    for i, cfg in enumerate(configs):
        ours = [results[r][i] for r in range(world)]
        ref = _reference(cfg, world)
        for r in range(1, world):
            for a, b in zip(ours[0]["steps"], ours[r]["steps"], strict=True):
                assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), (r, cfg)
        rtol, atol = TOLERANCE[cfg["eps"]]
        for step, (a, b) in enumerate(zip(ours[0]["steps"], ref["steps"], strict=True)):
            for p, q in zip(a, b, strict=True):
                torch.testing.assert_close(p, q, rtol=rtol, atol=atol,
                                           msg=lambda m, s=step, c=cfg: f"step {s} {c}: {m}")
        moved = min(float((p - q).abs().max())
                    for p, q in zip(ref["steps"][-1], ref["steps"][0], strict=True))
        assert moved > 1e-4, (cfg, moved)
        held = [name for o in ours for name in o["held"]]
        workers = round(world * ours[0]["fraction"])
        assert workers == (world if cfg["strategy"] == "comm_opt" else world // 2)
        assert sorted(held) == sorted(ref["held"] * workers), (cfg, held)
