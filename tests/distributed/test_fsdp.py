"""K-FAC on a model sharded by FSDP2 (``fully_shard``): gloo ranks equal one process.

Every rank shards the same float64 model with ``fully_shard`` on each layer and on the
root (parameters and gradients are ``DTensor`` objects sharded on dim 0; layer sizes are
chosen so shards are uneven) and trains it on its share of the global batch; FSDP2
averages the gradients over ranks (reduce-scatter). The parent trains the same model,
unsharded, in one process on the global batch. With mean-reduced losses each rank's output
gradients are ``W`` times the single-process ones, so the reference multiplies its loss by
``W`` for backward and divides the gradients by ``W`` before ``step()`` (as in
``tests/distributed/test_distributed.py``). The K-FAC side: the hooks see the unsharded weights and the
local batch's activations and output gradients; factors are averaged over all ranks to the
rank that decomposes them, which alone keeps them; each block's full gradient is gathered,
preconditioned by its gradient workers (the placement of ``grad_worker_fraction``) and each
rank keeps its rows.

Running factors on their owners (every configuration, 2 and 4 ranks and HSDP): each rank
keeps the running factors of exactly the blocks it decomposes (and the unplaced diagonal
ones), equal to the single process's; together the ranks keep each Kronecker block's once,
so the factor bytes per rank fall with the world size; ``state_dict(gather=True)`` gives
every rank every factor, and loading it keeps the owner's only; the silent-block warning
does not fire on ranks that keep no factor of a block.

``kaisa.EKFAC`` (Adam in the eigenbases, applied to the sharded parameters' rows) runs the
same loop on a larger batch (40 per rank): with running factors starting from zero, the
4-per-rank batch leaves ``fc1``'s 49 x 49 A factor of rank 8, and Adam's elementwise step is
not invariant to the arbitrary basis of its null space (measured with that batch: ``fc1``
1.9e-2 apart after two steps, every other block within 4e-13).

Tolerance as in ``tests/distributed/test_distributed.py`` (``rtol=1e-8``): the runs differ only in the
order of float64 sums, while every mistake this test is for (a shard written to the wrong
rows, a missing average, a rank's own factors) is of the order of the step itself
(asserted: every parameter moves by more than ``1e-4``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import kaisa
from kaisa.utils.shards import local_rows
from tests.distributed.test_distributed_transformer import _batch, _gpt
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 3
BATCH_PER_RANK = 4
RTOL, ATOL = 1e-8, 1e-10


class Net(nn.Module):
    """Conv + two Linear layers with output sizes that shard unevenly (3, 7, 5 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 4 * 4, 7)
        self.fc2 = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def _data(world: int, step: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = world * per_rank
    return (torch.randn(n, 2, 4, 4, generator=gen, dtype=torch.float64),
            torch.randint(0, 5, (n,), generator=gen))


def _kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(
        grad_worker_fraction=cfg["strategy"], compute_method=cfg["method"],
        inv_dtype=torch.float64, factor_decay=0.9, damping=0.01, kl_clip=0.05, lr=0.1,
        inv_update_steps=2, update_factors_in_hook=cfg.get("in_hook", True),
        colocate_factors=cfg.get("colocate", True),
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    whole: torch.Tensor = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().clone()


def build_model(gpt: bool, *, sharded: bool, mesh_shape: tuple[int, ...] | None,
                reshard_after_forward: bool = True) -> nn.Module:
    """The byte GPT or :class:`Net` (seed 0); ``sharded``: ``fully_shard`` on each layer
    (each Transformer block) and on the root, over a 1-D mesh or a ``mesh_shape`` HSDP mesh."""
    torch.manual_seed(0)
    model: nn.Module = _gpt() if gpt else Net().double()
    if sharded:
        mesh = None
        if mesh_shape is not None:
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        for layer in (model.blocks if gpt else (model.conv, model.fc1, model.fc2)):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def _train(cfg: dict[str, Any], world: int, rank: int | None,
           mesh_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """STEPS of SGD after KFACPreconditioner; ``rank=None`` is the unsharded reference."""
    gpt = cfg.get("model") == "gpt"
    model = build_model(gpt, sharded=rank is not None, mesh_shape=mesh_shape)
    pre: Any = None
    opt: torch.optim.Optimizer
    per_rank = cfg.get("batch", BATCH_PER_RANK)
    if cfg.get("product") == "ekfac":
        opt = kaisa.EKFAC(model, lr=1e-2, eps=1e-6, weight_decay=0.1, basis_update_steps=2,
                          basis_refresh="qr", grad_worker_fraction=cfg["strategy"])
        curvature = opt.curvature
    elif cfg.get("product") == "kfac_muon":  # the full matrix orthogonalised, rows kept
        opt = kaisa.KFACMuon(model, lr=0.05, curvature=cfg.get("mode", "eigen"), adam_eps=1e-6,
                             refresh_steps=2, basis_refresh="qr", ns_dtype=torch.float64,
                             grad_worker_fraction=cfg["strategy"])
        curvature = opt.curvature
    else:
        pre = kaisa.KFACPreconditioner(model, **_kwargs(cfg),
                                       layer_kinds="all" if gpt else ("linear", "conv2d"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        curvature = pre.curvature
    scale = float(world) if rank is None else 1.0
    steps = [[_full(p) for p in model.parameters()]]
    # The silent-block warning must not fire on ranks that keep no factors of a block.
    with warnings.catch_warnings(record=True) as silent:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if gpt:
                x, y = _batch(world, step, rank)
            else:
                x, y = _data(world, step, per_rank)
                if rank is not None:
                    x, y = (t[rank * per_rank : (rank + 1) * per_rank] for t in (x, y))
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            loss: torch.Tensor = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1)) * scale
            loss.backward()
            if rank is None:
                for p in model.parameters():
                    assert p.grad is not None
                    p.grad.div_(world)
            else:
                assert all(isinstance(p.grad, DTensor) for p in model.parameters())
            if pre is not None:
                pre.step()
            opt.step()
            steps.append([_full(p) for p in model.parameters()])
    held_ok = None
    if rank is not None:  # the core's entries keep only this rank's rows (gradients still set)
        held_ok = [e.direction.numel() == _held_count(e.block) and e.inner is not None
                   for e in curvature.precondition(0.01)]
    engine, blocks = curvature.engine, curvature.blocks
    placed = engine.placement.layers
    gathered, reloaded = None, None
    if pre is not None:  # a full state on every rank; loading it keeps the owners' factors
        full = pre.state_dict(gather=True)
        gathered = {n: (e.get("A"), e.get("G")) for n, e in full["layers"].items()}
        pre.load_state_dict(full)
        reloaded = sorted(n for n, b in blocks.items() if b.a is not None or b.g is not None)
    return {
        "steps": steps,
        "held_rows": held_ok,
        "fraction": float(engine.grid.fraction),
        "factors": sorted(n for n, b in blocks.items()  # the input mode records A alone
                          if (b.g is not None or cfg.get("mode") == "input")
                          and (b.diagonal or b.a is not None)),
        # Running factors live where the placement decomposes them (every rank: unplaced).
        "owners": sorted(n for n in blocks if n not in placed
                         or engine.rank in (placed[n].a_rank, placed[n].g_rank)),
        "values": {n: (b.a, b.g) for n, b in blocks.items() if b.a is not None or b.g is not None},
        "factor_bytes": {n: b.memory_usage()["factors"] for n, b in blocks.items()},
        "silent": [str(w.message) for w in silent if "did not fire" in str(w.message)],
        "gathered": gathered,
        "reloaded": reloaded,
        "blocks": sorted(curvature.blocks),
        "held": engine.placement.held_by(engine.rank),
    }


def _held_count(block: Any) -> int:
    """Elements of the block's rows this rank's shards hold."""
    count = 0
    for p, rows in zip(block.parameters(), block.row_slices(), strict=True):
        covered = range(p.shape[0])[rows or slice(None)]
        held = local_rows(p)
        overlap = min(covered.stop, held.stop) - max(covered.start, held.start)
        count += max(0, overlap) * math.prod(p.shape[1:])
    return count


def _ranks(rank: int, world: int, cfgs: list[dict[str, Any]],
           mesh_shape: tuple[int, ...] | None) -> list[Any]:
    """Every configuration's run, then (on a 1-D mesh) the errors of the unsupported cases."""
    runs: list[Any] = [_train(cfg, world, rank, mesh_shape) for cfg in cfgs]
    return runs if mesh_shape is not None else [*runs, _refusals(rank, world)]


def _refusals(rank: int, world: int) -> list[str]:
    """The errors of the unsupported cases: kaisa.KFAC's double-backward ``J v`` on a
    sharded model, a dim-1 shard."""
    model = Net().double()
    fully_shard(model)
    errors = []
    with pytest.raises(ValueError, match="FSDP2") as err:
        kaisa.KFAC(model, loss="cross_entropy", jvp="double_backward")
    errors.append(str(err.value))
    mesh = init_device_mesh("cpu", (world,))
    with pytest.raises(ValueError, match="dim 0") as err:
        local_rows(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
    errors.append(str(err.value))
    return errors


def _check(cfgs: list[dict[str, Any]], world: int,
           mesh_shape: tuple[int, ...] | None = None) -> list[list[Any]]:
    results = run_distributed(_ranks, world, cfgs, mesh_shape, timeout=240.0)
    for i, cfg in enumerate(cfgs):
        ref = _train(cfg, world, None)
        assert ref["factors"] == ref["blocks"] and len(ref["blocks"]) >= 3
        moved = [float((b - a).abs().max()) for a, b in zip(ref["steps"][0], ref["steps"][-1],
                                                              strict=True)]
        assert min(moved) > 1e-4, moved
        for rank_results in results:
            got = rank_results[i]
            # Each rank keeps the running factors of the blocks it decomposes only, equal
            # to the single process's.
            assert got["factors"] == got["owners"] and set(got["values"]) == set(got["owners"])
            assert not got["silent"], (cfg, got["silent"])
            for name, sides in got["values"].items():
                for have, want in zip(sides, ref["values"][name], strict=True):
                    assert (have is None) == (want is None), (cfg, name)
                    if have is not None:
                        torch.testing.assert_close(have, want, rtol=RTOL, atol=ATOL)
            if got["gathered"] is not None:  # state_dict(gather=True): every factor
                assert got["reloaded"] == got["owners"], cfg
                assert set(got["gathered"]) == set(ref["values"])
                for name, sides in got["gathered"].items():
                    for have, want in zip(sides, ref["values"][name], strict=True):
                        assert (have is None) == (want is None), (cfg, name)
                        if have is not None:
                            torch.testing.assert_close(have, want, rtol=RTOL, atol=ATOL)
            for step, (want, have) in enumerate(zip(ref["steps"], got["steps"], strict=True)):
                for w, h in zip(want, have, strict=True):
                    torch.testing.assert_close(h, w, rtol=RTOL, atol=ATOL,
                                               msg=f"{cfg} step {step}")
            assert all(got["held_rows"]), cfg
        # Every block's factors are kept somewhere; a Kronecker block's (A and G
        # colocated) on exactly one rank, so the factor bytes per rank fall with the
        # world size: together they are the single process's. (Not colocated: on the
        # two ranks that decompose A and G, both factors, which pi-damping reads.)
        assert set().union(*(r[i]["factors"] for r in results)) == set(ref["factors"]), cfg
        for name, nbytes in ref["factor_bytes"].items():
            holders = [r[i]["factor_bytes"][name] for r in results
                       if r[i]["factor_bytes"][name]]
            unplaced = name not in {n for r in results for n in r[i]["held"]}
            owners = sum(name in r[i]["owners"] for r in results)
            assert holders == [nbytes] * owners, (cfg, name)
            assert owners == (world if unplaced else 1 if cfg.get("colocate", True) else 2), (
                cfg, name)
        for other in results[1:]:  # bit-identical parameters on every rank
            for a, b in zip(results[0][i]["steps"][-1], other[i]["steps"][-1], strict=True):
                assert torch.equal(a, b), cfg
    return results


CONFIGS_2 = [{"strategy": "comm_opt", "method": "eigen"},
             {"strategy": "comm_opt", "method": "inverse", "in_hook": False},
             {"strategy": "mem_opt", "method": "eigen"},
             {"strategy": "mem_opt", "method": "inverse"},
             {"strategy": "mem_opt", "product": "ekfac", "batch": 40},
             {"strategy": "mem_opt", "method": "eigen", "model": "gpt"},
             {"strategy": "comm_opt", "product": "kfac_muon", "batch": 40},
             {"strategy": "mem_opt", "product": "kfac_muon", "mode": "input", "batch": 40}]


def test_fsdp2_two_ranks_equal_one_process() -> None:
    """Every strategy on 2 ranks, both methods, EKFAC, KFACMuon's eigen and input modes, the byte GPT with every block kind
    (attention's row blocks, the tied embedding, LayerNorms); the unsupported cases' errors
    (``kaisa.KFAC`` itself: ``tests/kfac/test_fsdp_kfac.py``)."""
    results = _check(CONFIGS_2, 2)
    fractions = [r["fraction"] for r in results[0][:-1]]
    assert fractions == [1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0, 0.5]
    # MEM-OPT: each block's decompositions on exactly one rank.
    held = [set(r[2]["held"]) for r in results]
    assert held[0].isdisjoint(held[1]) and held[0] | held[1] == {"conv", "fc1", "fc2"}
    # Unsupported: kaisa.KFAC's double-backward J v on a sharded model, a dim-1 shard.
    for errors in (r[-1] for r in results):
        assert "needs jvp='forward'" in errors[0] and "dim 0" in errors[1]


CONFIGS_4 = [{"strategy": "hybrid_opt", "method": "eigen"},
             {"strategy": "mem_opt", "method": "inverse"},
             {"strategy": "hybrid_opt", "method": "inverse", "colocate": False}]


@pytest.mark.slow
def test_fsdp2_four_ranks_equal_one_process() -> None:
    results = _check(CONFIGS_4, 4)
    assert [r["fraction"] for r in results[0][:-1]] == [0.5, 0.25, 0.5]


def test_hsdp_2x2_equals_one_process() -> None:
    """A 2-D mesh (replicate x shard, 2 x 2): parameters sharded over 2 ranks, replicated twice."""
    results = _check([{"strategy": "hybrid_opt", "method": "eigen"}], 4, (2, 2))
    assert results[0][0]["fraction"] == 0.5
