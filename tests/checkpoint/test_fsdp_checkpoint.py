"""Sharded checkpoints (``kaisa.checkpoint``, DCP) of K-FAC under FSDP2, and a dead rank.

The float64 model of ``tests/distributed/test_fsdp.py`` is sharded by ``fully_shard`` on 2 gloo ranks
and trained ``K`` steps; the ranks save a DCP checkpoint and train ``N`` more (the
uninterrupted run). Fresh processes build fresh models (other initial weights),
optimizers and preconditioners, load the checkpoint and train the same ``N`` steps:

* at the same world size the parameters are bit-equal (``torch.equal``) to the
  uninterrupted run's, for KFACPreconditioner + SGD and for EKFAC, MEM-OPT and COMM-OPT,
  and for ``kaisa.KFAC`` (Monte-Carlo curvature, MEM-OPT; the conv layer left to its
  first-order AdamW, so the checkpoint holds the velocity, AdamW's moments, the damping
  the LM rule adapted and the sampler's state, each of which a resume needs bit for bit).
  The decompositions are refreshed every 3 steps and the checkpoint is taken at step 2, so
  the steps after loading use decompositions computed from older factors than the saved
  ones: recomputing them on load would not be bit-exact (EKFAC's moments exist only in
  the checkpoint);
* at another world size (one rank, or four on a 1-D or a 2 x 2 HSDP mesh: ``slow``) the run continues as the
  uninterrupted one up to the order of float sums (``rtol=1e-8``, as ``tests/distributed/test_fsdp.py``
  compares ranks with one process): each rank's loss is scaled so its output gradients
  are those of the 2-rank run (``tests/distributed/test_fsdp.py``'s construction) and the gradients
  are scaled back (KFAC's own loss is a mean over the rank's share, which FSDP2 averages
  and its Monte-Carlo draw shares out: ``tests/kfac/test_fsdp_kfac.py``).

Also: each rank writes only the K-FAC entries it owns (disjoint over ranks, together
every block's); bad checkpoints raise ``ValueError`` and change nothing, on every rank also
when only one rank reads the bad part (a NaN in one rank's rows of KFAC's velocity); a
rank that dies or hangs under FSDP2 fails the other within ``collective_timeout``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import kaisa
from kaisa import checkpoint
from tests.distributed.test_fsdp import Net, _data
from tests.support.dist import run_distributed, run_distributed_raw

SAVE_WORLD = 2
K, N = 2, 3  # decompositions at steps 0 and 3: the checkpoint falls between them
RTOL, ATOL = 1e-8, 1e-10

CONFIGS = [
    {"product": "kfac", "strategy": "mem_opt", "method": "eigen"},
    {"product": "kfac", "strategy": "comm_opt", "method": "inverse"},
    {"product": "ekfac", "strategy": "mem_opt"},
    {"product": "ekfac", "strategy": "comm_opt"},
    {"product": "kfac_opt", "strategy": "mem_opt", "curvature": "mc"},  # kaisa.KFAC
]


def _per_rank(cfg: dict[str, Any]) -> int:
    """Samples per rank of the 2-rank run (EKFAC's larger batch: ``tests/distributed/test_fsdp.py``)."""
    return 40 if cfg["product"] == "ekfac" else 4


def _kfac(model: nn.Module, cfg: dict[str, Any]) -> kaisa.KFAC:
    """``kaisa.KFAC`` on the linear layers (the conv follows AdamW); ``cfg['lr']``: a fixed
    lr (then every parameter steps with SGD: no first-order optimizer)."""
    fixed = ({"lr": cfg["lr"], "momentum": 0.5, "adaptive_damping": False,
              "compute_method": "inverse"} if "lr" in cfg else {})  # adaptive: inverse too
    return kaisa.KFAC(model, loss="cross_entropy", curvature=cfg.get("curvature", "mc"), seed=7,
                      damping=0.01, damping_interval=2, inv_update_steps=3,
                      inv_dtype=torch.float64, grad_worker_fraction=cfg.get("strategy", 1.0),
                      layer_kinds=("linear",), **fixed)


def _build(cfg: dict[str, Any], *, seed: int = 0, wide: bool = False,
           hsdp: tuple[int, int] | None = None,
           ) -> tuple[nn.Module, torch.optim.Optimizer, kaisa.KFACPreconditioner | None]:
    """The sharded model, its optimizer and preconditioner (``wide``: fc1 of another size;
    ``hsdp``: on a ``(replicate, shard)`` mesh of that shape)."""
    torch.manual_seed(seed)
    model = Net().double()
    if wide:
        model.fc1, model.fc2 = nn.Linear(48, 9).double(), nn.Linear(9, 5).double()
    mesh = None if hsdp is None else init_device_mesh("cpu", hsdp,
                                                      mesh_dim_names=("replicate", "shard"))
    for layer in (model.conv, model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if cfg["product"] == "kfac_opt":
        return model, _kfac(model, cfg), None
    if cfg["product"] == "ekfac":
        opt = kaisa.EKFAC(model, lr=1e-2, eps=1e-6, weight_decay=0.1, basis_update_steps=3,
                          basis_refresh="qr", grad_worker_fraction=cfg["strategy"])
        return model, opt, None
    pre = kaisa.KFACPreconditioner(
        model, grad_worker_fraction=cfg["strategy"], compute_method=cfg["method"],
        inv_dtype=torch.float64, factor_decay=0.9, damping=0.01, kl_clip=0.05, lr=0.1,
        inv_update_steps=3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), pre


def _train(cfg: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer,
           pre: kaisa.KFACPreconditioner | None, steps: range, rank: int, world: int) -> None:
    """Steps ``steps`` of the global batch, split over ``world`` ranks.

    Each rank's loss is scaled by ``SAVE_WORLD / world`` so its output gradients (hence
    the factors) are the 2-rank run's; the averaged gradients are scaled back. KFAC steps
    on a closure of the rank's share (no scaling: the module docstring).
    """
    scale = SAVE_WORLD / world
    local = SAVE_WORLD * _per_rank(cfg) // world
    for step in steps:
        x, y = _data(SAVE_WORLD, step, _per_rank(cfg))
        x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
        if isinstance(opt, kaisa.KFAC):
            opt.step(lambda x=x, y=y: (model(x), y))
            continue
        opt.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x), y) * scale).backward()
        if scale != 1.0:
            for p in model.parameters():
                assert p.grad is not None
                p.grad.div_(scale)
        if pre is not None:
            pre.step()
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


def _path(root: str, i: int) -> str:
    return os.path.join(root, f"cfg{i}")


# ---------------------------------------------------------------------- the jobs
def _uninterrupted(rank: int, world: int, root: str) -> list[dict[str, Any]]:
    """K steps, save, N steps; what each rank wrote of the K-FAC part."""
    out = []
    for i, cfg in enumerate(CONFIGS):
        model, opt, pre = _build(cfg)
        _train(cfg, model, opt, pre, range(K), rank, world)
        owner = opt if pre is None else pre
        written = {name: sorted(entries)
                   for name, entries in checkpoint.kfac_state_dict(owner)["layers"].items()}
        held = {name: sorted(block.decomposition)
                for name, block in owner.curvature.blocks.items()}
        checkpoint.save(_path(root, i), model, opt, pre)
        if isinstance(opt, kaisa.KFAC):  # and one with a NaN in the last rank's velocity rows
            local = opt.state[model.fc1.weight]["velocity"].to_local()
            kept = local.clone()
            if rank == world - 1:
                local[0, 0] = float("nan")
            checkpoint.save(os.path.join(root, "nan"), model, opt, pre)
            local.copy_(kept)
        _train(cfg, model, opt, pre, range(K, K + N), rank, world)
        out.append({"params": _params(model), "written": written, "held": held})
    # A DCP checkpoint of the model alone (no K-FAC part), for the bad-input test.
    model, _, _ = _build(CONFIGS[0])
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(root, "plain"))
    return out


def _resumed(rank: int, world: int, root: str,
             hsdp: tuple[int, int] | None = None) -> dict[str, Any]:
    """Fresh objects (other initial weights) load each checkpoint and train N steps; at
    the saving world size, first the bad checkpoints' errors (:func:`_refusals`)."""
    errors = _refusals(root) if world == SAVE_WORLD else []
    params = []
    for i, cfg in enumerate(CONFIGS):
        model, opt, pre = _build(cfg, seed=1, hsdp=hsdp)
        checkpoint.load(_path(root, i), model, opt, pre)
        _train(cfg, model, opt, pre, range(K, K + N), rank, world)
        params.append(_params(model))
    return {"params": params, "errors": errors}


def _refusals(root: str) -> list[str]:
    """Bad checkpoints: each raises ValueError and leaves the objects as they were."""
    errors = []
    cases = [  # (checkpoint, configuration built, wide model)
        ("cfg0", CONFIGS[0], True),   # other layer sizes
        ("cfg2", CONFIGS[0], False),  # an EKFAC checkpoint into a preconditioner
        ("cfg0", CONFIGS[2], False),  # a preconditioner's into EKFAC
        ("plain", CONFIGS[0], False),  # no K-FAC part
        ("cfg0", {**CONFIGS[0], "method": "inverse"}, False),  # eigen's state into inverse
        ("cfg4", CONFIGS[0], False),  # a kaisa.KFAC checkpoint into a preconditioner
        ("cfg0", CONFIGS[4], False),  # a preconditioner's into kaisa.KFAC
        ("cfg4", {**CONFIGS[4], "lr": 0.1}, False),  # adaptive KFAC's into a fixed-lr one
        ("nan", CONFIGS[4], False),  # a velocity shard that is not finite, on one rank
    ]
    for name, cfg, wide in cases:
        model, opt, pre = _build(cfg, seed=1, wide=wide)
        before = _params(model)
        with pytest.raises(ValueError) as err:
            checkpoint.load(os.path.join(root, name), model, opt, pre)
        errors.append(str(err.value))
        owner = opt if pre is None else pre
        assert all(torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
        assert owner.steps == 0 and not opt.state
        assert all(b.a is None and not b.decomposition for b in owner.curvature.blocks.values())
        if isinstance(opt, kaisa.KFAC):
            assert opt.damping == 0.01 and (opt.first_order is None or not opt.first_order.state)
    return errors


# ---------------------------------------------------------------------- the tests
def _entries(root: str, i: int) -> dict[str, set[str]]:
    """Per block, the tensors the checkpoint holds."""
    saved = FileSystemReader(_path(root, i)).read_metadata().state_dict_metadata
    out: dict[str, set[str]] = {}
    for fqn in saved:
        if fqn.startswith("kfac.layers."):
            name, _, key = fqn[len("kfac.layers."):].rpartition(".")
            out.setdefault(name, set()).add(key)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_dcp_resume_is_bit_exact_and_loads_at_another_world_size(tmp_path: Any) -> None:
    """2 ranks save; 2 fresh ranks resume bit for bit; 1 rank continues within rounding."""
    root = str(tmp_path)
    ref = run_distributed(_uninterrupted, SAVE_WORLD, root, timeout=150.0)
    for i, cfg in enumerate(CONFIGS):
        # Each entry written once: by its owner, disjoint over ranks, all of them together.
        written = [r[i]["written"] for r in ref]
        saved = _entries(root, i)
        kfac_opt = cfg["product"] == "kfac_opt"
        assert set(saved) == ({"fc1", "fc2"} if kfac_opt else {"conv", "fc1", "fc2"}), cfg
        for name, keys in saved.items():
            assert {"A", "G"} < keys and len(keys) > 4, (cfg, name, keys)
            mine = [set(w[name]) for w in written]
            assert mine[0].isdisjoint(mine[1]) and mine[0] | mine[1] == keys, (cfg, name)
            # Decompositions are written by a rank that holds them.
            for rank, r in enumerate(ref):
                assert mine[rank] - {"A", "G", "skipped_a", "skipped_g"} <= set(
                    r[i]["held"][name]), (cfg, name)
        if cfg["strategy"] == "mem_opt":  # each block's decompositions on one rank only
            assert all(bool(ref[0][i]["held"][n]) != bool(ref[1][i]["held"][n]) for n in saved)
        if kfac_opt:  # the velocity of the linear layers, AdamW's moments of the conv
            fqns = FileSystemReader(_path(root, i)).read_metadata().state_dict_metadata
            assert {"kfac.generator", "optim.state.fc1.weight.velocity",
                    "optim.first_order.state.conv.weight.exp_avg_sq"} <= set(fqns)
    resumed = run_distributed(_resumed, SAVE_WORLD, root, timeout=150.0)
    for i, cfg in enumerate(CONFIGS):
        for rank in range(SAVE_WORLD):
            for want, got in zip(ref[rank][i]["params"], resumed[rank]["params"][i],
                                 strict=True):
                assert torch.equal(want, got), (cfg, rank)
    one = run_distributed(_resumed, 1, root, timeout=150.0)[0]["params"]
    for i, cfg in enumerate(CONFIGS):
        for want, got in zip(ref[0][i]["params"], one[i], strict=True):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=str(cfg))
    for rank_results in resumed:
        (sizes, ekfac_into_pre, pre_into_ekfac, plain, method, kfac_into_pre, pre_into_kfac,
         fixed_lr, nan) = rank_results["errors"]
        assert "unexpected entries" in method and "another compute_method" in method, method
        assert "do not match this model's" in sizes and "'fc1'" in sizes, sizes
        assert "of a kaisa.EKFAC, not of a kaisa.KFACPreconditioner" in ekfac_into_pre
        assert "of a kaisa.KFACPreconditioner, not of a kaisa.EKFAC" in pre_into_ekfac
        assert "not a kaisa.checkpoint" in plain, plain
        assert "of a kaisa.KFAC, not of a kaisa.KFACPreconditioner" in kfac_into_pre
        assert "of a kaisa.KFACPreconditioner, not of a kaisa.KFAC" in pre_into_kfac
        assert "first_order does not fit" in fixed_lr, fixed_lr
        assert "KFAC optimizer state (velocity) is not finite" in nan, nan


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("hsdp", [None, (2, 2)])
def test_dcp_checkpoint_of_two_ranks_loads_on_four(tmp_path: Any,
                                                   hsdp: tuple[int, int] | None) -> None:
    """Saved at 2 ranks, loaded at 4 (the placement re-placed: MEM-OPT's owners move), on
    a 1-D mesh and on a 2 x 2 HSDP mesh (each shard replicated twice)."""
    root = str(tmp_path)
    ref = run_distributed(_uninterrupted, SAVE_WORLD, root, timeout=150.0)
    four = run_distributed(_resumed, 4, root, hsdp, timeout=240.0)
    for i, cfg in enumerate(CONFIGS):
        for rank_results in four:
            for want, got in zip(ref[0][i]["params"], rank_results["params"][i], strict=True):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=str(cfg))


def test_dcp_checkpoint_of_a_plain_model_in_one_process(tmp_path: Any) -> None:
    """No process group, no FSDP2: the same checkpoints, resumed bit for bit."""
    for i, cfg in enumerate(CONFIGS[::2]):
        wants, gots = [], []
        for fresh in (False, True):
            torch.manual_seed(1 if fresh else 0)
            model = Net().double()
            opt: torch.optim.Optimizer
            pre = None
            if cfg["product"] == "kfac_opt":
                opt = _kfac(model, {})
            elif cfg["product"] == "ekfac":
                opt = kaisa.EKFAC(model, lr=1e-2, eps=1e-6, basis_update_steps=3)
            else:
                pre = kaisa.KFACPreconditioner(model, inv_dtype=torch.float64, inv_update_steps=3)
                opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
            path = str(tmp_path / f"plain{i}")
            if fresh:
                checkpoint.load(path, model, opt, pre)
            else:
                _train(cfg, model, opt, pre, range(K), 0, SAVE_WORLD)
                checkpoint.save(path, model, opt, pre)
            _train(cfg, model, opt, pre, range(K, K + N), 0, SAVE_WORLD)
            (gots if fresh else wants).append(_params(model))
        assert all(torch.equal(a, b) for a, b in zip(wants[0], gots[0], strict=True)), cfg


# ---------------------------------------------------------------------- a dead or hung rank
HANG_S = 10.0  # how long a hung rank sleeps before it exits (past every bound tested)


def _dead_peer_job(rank: int, world: int, mode: str, strategy: str,
                   collective_timeout: float | None) -> None:
    """FSDP2: the last rank dies (or hangs) after its backward pass, before ``pre.step()``;
    the survivor's step must fail, not wait for it."""
    cfg = CONFIGS[0]
    model, opt, _ = _build(cfg)
    pre = kaisa.KFACPreconditioner(model, grad_worker_fraction=strategy,
                                   inv_dtype=torch.float64, collective_timeout=collective_timeout)
    per_rank = _per_rank(cfg)
    for step in range(3):
        x, y = _data(world, step, per_rank)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if step == 1 and rank == world - 1:
            if mode == "hang":
                time.sleep(HANG_S)
            os._exit(0)
        start = time.monotonic()
        try:
            pre.step()
        except RuntimeError as err:
            raise RuntimeError(f"{err} [after {time.monotonic() - start:.2f}s]") from None
        opt.step()


def _survivor_error(mode: str, strategy: str, collective_timeout: float | None,
                    pg_timeout: float) -> tuple[str, float]:
    """The survivor's error and how long its step waited."""
    results = run_distributed_raw(_dead_peer_job, 2, mode, strategy, collective_timeout,
                                  timeout=80, pg_timeout=pg_timeout)
    assert not results[1].ok and "no result" in results[1].error
    assert not results[0].ok, "the survivor should fail"
    err = results[0].error
    return err, float(err.split("[after ")[1].split("s]")[0])


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_fsdp2_dead_peer_fails_the_survivor_at_once() -> None:
    """A rank that exits: the survivor's next collective fails at once (measured: K-FAC's
    factor allreduce, or the gradient gather when the exiting rank's part of the allreduce
    went out before it exited), although the process group would wait 30 s."""
    err, waited = _survivor_error("exit", "mem_opt", None, pg_timeout=30.0)
    assert "did not complete" in err or "Connection" in err, err
    assert waited < 5.0, err


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_fsdp2_collective_timeout_bounds_a_hung_peer() -> None:
    """COMM-OPT: the survivor waits for the hung rank's decompositions in K-FAC's broadcast;
    the process group would wait 60 s, ``collective_timeout=2`` fails it in ~2 s."""
    err, waited = _survivor_error("hang", "comm_opt", 2.0, pg_timeout=60.0)
    assert "K-FAC broadcast of decompositions on ranks [0, 1] did not complete" in err, err
    assert "timeout 0:00:02" in err, err
    assert waited < 2.0 + 5.0, err


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fsdp2_gradient_gather_is_bounded_by_collective_timeout() -> None:
    """MEM-OPT: no K-FAC collective precedes the gradient gather, K-FAC's own all-to-all
    (``kaisa.distributed.fsdp``): ``collective_timeout=2`` fails it in ~2 s where the
    process group would wait 60 s (``docs/distributed.md``, "Checkpoints (DCP)")."""
    err, waited = _survivor_error("hang", "mem_opt", 2.0, pg_timeout=60.0)
    assert "K-FAC all-to-all of gradient_gather on ranks [0, 1] did not complete" in err, err
    assert "timeout 0:00:02" in err, err
    assert waited < 2.0 + 5.0, err
