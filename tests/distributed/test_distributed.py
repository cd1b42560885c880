"""Distributed K-FAC on spawned gloo ranks: equivalence with one process and edge cases.

Every rank trains the same float64 model on its shard of the global batch (gradients
averaged by DistributedDataParallel or by an explicit allreduce); the parent trains the
same model in one process on the global batch. With mean-reduced losses each rank's
output gradients are W times the single-process ones, so the reference multiplies the
loss by W for backward and divides the weight gradients by W before ``step()``.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kaisa
from tests.support.dist import run_distributed, run_distributed_raw

STRATEGIES = ("comm_opt", "mem_opt", "hybrid_opt")
STEPS = 4
BATCH_PER_RANK = 6


class Net(nn.Module):
    """Conv + two Linear layers, optionally an extra layer used on some steps only."""

    def __init__(self, extra: bool = False, tiny: bool = False) -> None:
        super().__init__()
        self.tiny = tiny
        if tiny:
            self.fc2 = nn.Linear(2 * 4 * 4, 5)
            return
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 10)
        self.extra = nn.Linear(10, 10) if extra else None
        self.fc2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        if self.tiny:
            return self.fc2(x.flatten(1))
        h = torch.tanh(self.conv(x)).flatten(1)
        h = torch.tanh(self.fc1(h))
        if self.extra is not None and use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h)


def _data(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = world * BATCH_PER_RANK
    x = torch.randn(n, 2, 4, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=gen)
    return x, y


def _kfac_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        grad_worker_fraction=cfg["strategy"],
        compute_method=cfg["method"],
        symmetry_aware=cfg["sym"],
        allreduce_bucket_cap_mb=cfg["bucket"],
        colocate_factors=cfg.get("colocate", True),
        accumulation_steps=cfg.get("accum", 1),
        memory_budget_mb=cfg.get("budget"),
        inv_dtype=torch.float64,
        factor_decay=0.9,
        damping=0.01,
        kl_clip=0.05,
        lr=0.1,
        inv_update_steps=cfg.get("ius", 2),
        decomposition_spread=cfg.get("spread", 1),
        factor_update_steps=cfg.get("fus", 1),
        update_factors_in_hook=cfg.get("in_hook", True),
    )


def _train(
    cfg: dict[str, Any], world: int, rank: int | None
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Trains one config; ``rank=None`` is the single-process reference."""
    torch.manual_seed(0)
    model = Net(extra=cfg.get("extra", False), tiny=cfg.get("tiny", False)).double()
    net: nn.Module = model
    if rank is not None and cfg.get("ddp", False):
        net = DistributedDataParallel(model)
    pre = kaisa.KFACPreconditioner(net, **_kfac_kwargs(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accum = cfg.get("accum", 1)
    scale = float(world) if rank is None else 1.0
    for step in range(STEPS):
        x, y = _data(world, step)
        if rank is not None:
            x = x[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
            y = y[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
        use_extra = step % 2 == 0
        opt.zero_grad(set_to_none=True)
        micro = BATCH_PER_RANK // accum
        for k in range(accum):
            if rank is None:
                # Micro-batch k of the reference = the k-th micro-batches of all ranks.
                idx = torch.cat(
                    [
                        torch.arange(
                            r * BATCH_PER_RANK + k * micro, r * BATCH_PER_RANK + (k + 1) * micro
                        )
                        for r in range(world)
                    ]
                )
            else:
                idx = torch.arange(k * micro, (k + 1) * micro)
            ctx = (
                net.no_sync()
                if isinstance(net, DistributedDataParallel) and k < accum - 1
                else contextlib.nullcontext()
            )
            with ctx:
                out = net(x[idx], use_extra)
                loss = nn.functional.cross_entropy(out, y[idx]) / accum
                (loss * scale).backward()
        if rank is None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(world)
        elif not isinstance(net, DistributedDataParallel):
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
        pre.step()
        opt.step()
    info = {
        "fraction": pre.grad_worker_fraction,
        "memory": pre.memory_usage(),
        "held": pre.placement.held_by(pre.rank),
        "stats": pre.communicator.stats.as_dict(),
    }
    return [p.detach().clone() for p in model.parameters()], info


def _equivalence_job(rank: int, world: int, configs: list[dict[str, Any]]) -> list[Any]:
    torch.set_default_dtype(torch.float64)
    return [_train(cfg, world, rank) for cfg in configs]


def _grid(world: int) -> list[dict[str, Any]]:
    strategies = STRATEGIES if world > 2 else ("comm_opt", "mem_opt")
    return [
        dict(strategy=s, method=m, sym=sym, bucket=b)
        for s in strategies
        for m in ("eigen", "inverse")
        for sym in (False, True)
        for b in (0.0, 25.0)
    ]


def _subset(world: int) -> list[dict[str, Any]]:
    """Covers every strategy, method (pi_inverse with A and G on different ranks), symmetry and bucketing value in a few configs."""
    cfgs = [
        dict(strategy="comm_opt", method="eigen", sym=True, bucket=25.0),
        dict(strategy="mem_opt", method="inverse", sym=True, bucket=0.0),
        dict(strategy="mem_opt", method="eigen", sym=False, bucket=25.0, extra=True),
        dict(strategy="comm_opt", method="pi_inverse", sym=False, bucket=0.0, colocate=False),
        dict(strategy="mem_opt", method="eigen", sym=True, bucket=0.0001, tiny=True),
        dict(strategy="mem_opt", method="inverse", sym=True, bucket=0.001, fus=2, in_hook=False),
        # decompositions spread over the interval: parts at steps 0 (all), 1 and 3
        dict(strategy="mem_opt", method="eigen", sym=False, bucket=25.0, ius=3, spread=2),
    ]
    if world > 2:
        cfgs += [
            dict(strategy="hybrid_opt", method="eigen", sym=True, bucket=25.0, colocate=False),
            dict(strategy="hybrid_opt", method="inverse", sym=False, bucket=0.0, extra=True),
            dict(strategy="hybrid_opt", method="eigen", sym=True, bucket=25.0, ius=3,
                 spread=3, colocate=False),
        ]
    return cfgs


def _check(configs: list[dict[str, Any]], world: int, results: list[Any]) -> None:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _check_float64(configs, world, results)
    finally:
        torch.set_default_dtype(old)


def _check_float64(configs: list[dict[str, Any]], world: int, results: list[Any]) -> None:
    for i, cfg in enumerate(configs):
        ref, _ = _train(cfg, world, None)
        rank0, _ = results[0][i]
        for r in range(world):
            params, _ = results[r][i]
            for p0, p in zip(rank0, params, strict=True):
                assert torch.equal(p, p0), f"rank {r} differs from rank 0: {cfg}"
        for p, q in zip(rank0, ref, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10, msg=f"vs single {cfg}")


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_equivalence_subset(world: int) -> None:
    configs = _subset(world)
    results = run_distributed(_equivalence_job, world, configs, timeout=170)
    _check(configs, world, results)
    # MEM-OPT keeps decompositions only for the rank's own layers.
    mem = [results[r][1][1] for r in range(world)]
    assert sorted(name for m in mem for name in m["held"]) == ["conv", "fc1", "fc2"]
    # Fewer layers than ranks (tiny model: one layer): only the owner holds it.
    tiny = [results[r][4][1] for r in range(world)]
    assert sum(len(t["held"]) for t in tiny) == 1


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_equivalence_full_grid(world: int) -> None:
    configs = _grid(world)
    results = run_distributed(_equivalence_job, world, configs, timeout=580)
    _check(configs, world, results)


# ----------------------------------------------------------------------------- DDP, auto


def _ddp_and_auto_job(rank: int, world: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    out: dict[str, Any] = {}
    ddp_cfgs = [
        dict(strategy="mem_opt", method="eigen", sym=True, bucket=25.0, ddp=True, accum=2),
        dict(strategy="comm_opt", method="inverse", sym=False, bucket=0.0, ddp=True),
    ]
    out["ddp"] = [_train(cfg, world, rank) for cfg in ddp_cfgs]
    out["ddp_cfgs"] = ddp_cfgs
    # memory_usage reflects the strategy.
    usage = {}
    for s in ("comm_opt", "mem_opt"):
        _, info = _train(dict(strategy=s, method="eigen", sym=False, bucket=25.0), world, rank)
        usage[s] = info["memory"]
    out["usage"] = usage
    # 'auto' with a budget that fits COMM-OPT, one that only fits smaller fractions.
    probe = kaisa.KFACPreconditioner(Net().double(), inv_dtype=torch.float64)
    est = {float(f): e.max_total_mb for f, e in probe.memory_estimates().items()}
    probe.remove_hooks()
    out["estimates"] = est
    auto = {}
    for label, budget in (("big", est[1.0] * 1.01), ("mid", (est[1.0] + est[0.5]) / 2)):
        cfg = dict(strategy="auto", method="eigen", sym=False, bucket=25.0, budget=budget)
        _, info = _train(cfg, world, rank)
        assert info["memory"]["total"] <= budget * 2**20, (info["memory"], budget)
        auto[label] = info["fraction"]
    try:
        kaisa.KFACPreconditioner(Net().double(), grad_worker_fraction="auto", memory_budget_mb=1e-4)
    except ValueError as err:
        auto["small_error"] = str(err)
    # A fraction that does not divide the world size.
    try:
        kaisa.KFACPreconditioner(Net().double(), grad_worker_fraction=0.75)
    except ValueError as err:
        out["bad_fraction"] = str(err)
    out["auto"] = auto
    return out


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_ddp_accumulation_auto_and_validation() -> None:
    world = 4
    results = run_distributed(_ddp_and_auto_job, world, timeout=140)
    r0 = results[0]
    _check(r0["ddp_cfgs"], world, [r["ddp"] for r in results])
    comm = max(r["usage"]["comm_opt"]["decompositions"] for r in results)
    mem = max(r["usage"]["mem_opt"]["decompositions"] for r in results)
    assert 0 < mem < comm
    assert all(
        r["usage"]["comm_opt"]["factors"] == r0["usage"]["comm_opt"]["factors"] for r in results
    )
    assert r0["auto"]["big"] == 1.0
    assert r0["estimates"][0.5] < r0["estimates"][1.0]
    assert r0["auto"]["mid"] == 0.5
    assert "no grad_worker_fraction fits" in r0["auto"]["small_error"]
    assert "valid fractions for world size 4: 1, 0.5" in r0["bad_fraction"]


# ----------------------------------------------------------------------------- dead peer


def _dead_peer_job(rank: int, world: int, mode: str, collective_timeout: float | None = None) -> float:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Net().double()
    pre = kaisa.KFACPreconditioner(
        model, grad_worker_fraction="mem_opt", inv_dtype=torch.float64,
        collective_timeout=collective_timeout,
    )
    for step in range(3):
        x, y = _data(world, step)
        shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        x, y = x[shard], y[shard]
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        if step == 1 and rank == world - 1:
            # Dies (or hangs) in the middle of the step, before pre.step().
            if mode == "hang":
                time.sleep(12.0)
            os._exit(0)
        start = time.monotonic()
        try:
            pre.step()
        except RuntimeError as err:
            raise RuntimeError(f"{err} [after {time.monotonic() - start:.2f}s]") from None
    return 0.0


@pytest.mark.distributed
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_peer_fails_within_timeout(mode: str) -> None:
    pg_timeout = 3.0
    results = run_distributed_raw(_dead_peer_job, 2, mode, timeout=80, pg_timeout=pg_timeout)
    assert not results[1].ok and "no result" in results[1].error
    assert not results[0].ok, "the survivor should fail"
    err = results[0].error
    assert "did not complete" in err and "timeout 0:00:03" in err, err
    waited = float(err.split("[after ")[1].split("s]")[0])
    assert waited < pg_timeout + 5.0, err


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_collective_timeout_argument_bounds_a_hung_peer() -> None:
    """The process group waits 60 s; collective_timeout=2 makes K-FAC give up in ~2 s."""
    results = run_distributed_raw(_dead_peer_job, 2, "hang", 2.0, timeout=80, pg_timeout=60.0)
    assert not results[0].ok, "the survivor should fail"
    err = results[0].error
    assert "did not complete" in err and "timeout 0:00:02" in err and "ranks [0, 1]" in err, err
    waited = float(err.split("[after ")[1].split("s]")[0])
    assert waited < 2.0 + 5.0, err


# ----------------------------------------------------------------------------- kaisa.KFAC


def _kfac_train(strategy: str, world: int, rank: int | None, spread: int = 1
                ) -> list[torch.Tensor]:
    """Adaptive KFAC (lr, momentum, damping) on a global batch split over ``world`` ranks."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    net: nn.Module = DistributedDataParallel(model) if rank is not None else model
    opt = kaisa.KFAC(
        model, loss="cross_entropy", curvature="empirical", damping=0.01, damping_interval=2,
        inv_update_steps=2, inv_dtype=torch.float64, grad_worker_fraction=strategy,
        decomposition_spread=spread,
    )
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = torch.randn(8 * world, 6, generator=g)
        y = torch.randint(0, 5, (8 * world,), generator=g)
        if rank is not None:
            x, y = x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8]
        opt.step(lambda x=x, y=y: (net(x), y))
    return [p.detach().clone() for p in model.parameters()]


def _kfac_job(rank: int, world: int, runs: list[tuple[str, int]]) -> list[list[torch.Tensor]]:
    return [_kfac_train(s, world, rank, spread) for s, spread in runs]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_adaptive_kfac_every_strategy_equals_one_process(world: int) -> None:
    runs = [(s, 1) for s in (STRATEGIES if world > 2 else ("comm_opt", "mem_opt"))]
    runs.append(("mem_opt", 2))  # decompositions spread: steps 0 (all), 1, 2, 3
    results = run_distributed(_kfac_job, world, runs, timeout=280)
    old = torch.get_default_dtype()
    try:
        references = {spread: _kfac_train("comm_opt", world, None, spread)
                      for spread in sorted({spread for _, spread in runs})}
    finally:
        torch.set_default_dtype(old)
    for i, (strategy, spread) in enumerate(runs):
        reference = references[spread]
        for r in range(world):
            for p0, p in zip(results[0][i], results[r][i], strict=True):
                assert torch.equal(p, p0), f"rank {r} differs from rank 0 ({strategy})"
        for p, q in zip(results[0][i], reference, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-8, atol=1e-10, msg=f"vs one process {strategy}")


# ----------------------------------------------------------------------------- same settings


def _mismatch_job(rank: int, world: int) -> dict[str, str]:
    """Each case gives rank 1 another setting; every rank must raise the same error."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Net().double()
    net = DistributedDataParallel(model)
    out: dict[str, str] = {}

    def attempt(label: str, build: Any) -> None:
        try:
            build()
        except ValueError as err:
            out[label] = str(err)

    other = rank == 1
    attempt("damping", lambda: kaisa.KFACPreconditioner(
        net, grad_worker_fraction="comm_opt", damping=1.0 if other else 0.01))
    attempt("method", lambda: kaisa.KFACPreconditioner(
        net, compute_method="inverse" if other else "eigen"))
    attempt("callable", lambda: kaisa.KFACPreconditioner(
        net, factor_decay=(lambda s: 0.5) if other else (lambda s: 0.95)))
    attempt("kfac", lambda: kaisa.KFAC(
        model, loss="cross_entropy", damping_interval=3 if other else 2))
    attempt("kfac core", lambda: kaisa.KFAC(
        model, loss="cross_entropy", inv_update_steps=5 if other else 2))
    attempt("same", lambda: kaisa.KFACPreconditioner(net, damping=0.01, loglevel=10 + rank))
    pre = kaisa.KFACPreconditioner(net, damping=0.01)
    state = pre.state_dict()
    if other:
        state["damping"] = 1.0
    attempt("load", lambda: pre.load_state_dict(state))
    out["damping after load"] = str(pre.damping)
    opt = kaisa.KFAC(model, loss="cross_entropy")
    kfac_state = opt.state_dict()
    if other:
        kfac_state["kaisa"]["steps"] = 7
    attempt("kfac load", lambda: opt.load_state_dict(kfac_state))
    out["kfac steps after load"] = str(opt.steps)
    dist.barrier()  # every rank is still in step
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_different_configurations_on_two_ranks_fail_on_every_rank() -> None:
    results = run_distributed(_mismatch_job, 2, timeout=110)
    assert results[0] == results[1], results  # the same message on every rank
    out = results[0]
    assert out["damping"] == (
        "kaisa: the K-FAC configuration differs across ranks: damping is 0.01 on rank 0, "
        "1.0 on rank 1; every rank must use the same settings"
    )
    assert "compute_method is ComputeMethod.EIGEN on rank 0, ComputeMethod.INVERSE on rank 1" in (
        out["method"]
    )
    assert "factor_decay is 0.95 on rank 0, 0.5 on rank 1" in out["callable"]
    assert "damping_interval is 2 on rank 0, 3 on rank 1" in out["kfac"]
    assert "inv_update_steps is 2 on rank 0, 5 on rank 1" in out["kfac core"]
    assert "same" not in out  # loglevel may differ
    assert "the loaded K-FAC state differs across ranks: damping is 0.01 on rank 0, 1.0 on rank 1" in (
        out["load"]
    )
    assert out["damping after load"] == "0.01"  # nothing loaded
    assert "the loaded KFAC state differs across ranks: steps is 0 on rank 0, 7 on rank 1" in (
        out["kfac load"]
    )
    assert out["kfac steps after load"] == "0"


def _one_rank_job(rank: int, world: int) -> bool:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective with one rank")

    dist.all_gather = refuse  # type: ignore[assignment]
    dist.all_gather_object = refuse  # type: ignore[assignment]
    pre = kaisa.KFACPreconditioner(Net().double(), damping=0.5)
    pre.load_state_dict(pre.state_dict())
    kaisa.KFAC(Net().double(), loss="cross_entropy")
    return True


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_one_rank_checks_its_configuration_without_a_collective() -> None:
    assert run_distributed(_one_rank_job, 1, timeout=50) == [True]


def _ddp_hung_peer_job(rank: int, world: int) -> float:
    """comm_opt + DDP, inverses every 3 steps: a peer hangs before its backward pass, so the
    survivor waits in DDP's gradient allreduce (no K-FAC collective in between)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = Net().double()
    ddp = DistributedDataParallel(model)
    pre = kaisa.KFACPreconditioner(ddp, inv_update_steps=3, inv_dtype=torch.float64,
                                   collective_timeout=60.0)
    for step in range(4):
        x, y = _data(world, step)
        shard = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
        if step == 1 and rank == world - 1:
            time.sleep(10.0)  # hangs past the survivor's process-group timeout
            os._exit(0)
        model.zero_grad()
        start = time.monotonic()
        try:
            nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
        except RuntimeError as err:
            raise RuntimeError(f"{err} [after {time.monotonic() - start:.2f}s]") from None
        pre.step()
    return 0.0


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_hung_peer_in_ddps_allreduce_is_bounded_by_the_process_group_timeout() -> None:
    """What bounds which wait (docs/reliability.md): K-FAC's collectives by
    ``collective_timeout``, the user's DDP allreduce by the process group's timeout (the
    app sets it with --pg-timeout), here 3 s although collective_timeout is 60 s."""
    pg_timeout = 3.0
    results = run_distributed_raw(_ddp_hung_peer_job, 2, timeout=80, pg_timeout=pg_timeout)
    assert not results[0].ok, "the survivor should fail"
    err = results[0].error
    waited = float(err.split("[after ")[1].split("s]")[0])
    assert waited < pg_timeout + 5.0, err
