"""Under FSDP2 each block's gradient goes to its gradient workers only, each rank gets its rows.

``tests/distributed/test_fsdp.py`` checks the results equal one process; this file checks the traffic
that gets them there, against explicit byte counts. ``tests.distributed.test_fsdp.Net`` on 2 ranks:
``torch.chunk`` splits the output rows of ``conv`` (3), ``fc1`` (7) and ``fc2`` (5) as
2+1, 4+3 and 3+2; a row holds 18+1, 48+1 and 7+1 float64 values (weight row + bias).
Per step and block a rank that is not the block's (MEM-OPT) worker sends the worker its
rows (``gradient_gather``) and receives its rows of the direction after a 24-byte header
(``<P, g>``, finite, valid: ``gradients``); the worker receives the other rank's rows and
sends that rank its rows. Under COMM-OPT every rank sends every other rank its rows and
nothing comes back. The all-gather this replaced moved every block's whole gradient to
every rank and the whole direction back (asserted to be more).

Also: which rows any rank holds and whom a rank reads them from, on a 1-D mesh and an
HSDP 2x2 mesh (each worker reads from its own replica); a worker without a result
(no decomposition yet) sends ``valid = 0``; bad inputs to ``exchange`` are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import kaisa
from kaisa.distributed import LocalCommunicator
from kaisa.utils.shards import local_rows, row_sources, rows_on
from tests.distributed.test_fsdp import Net, _data
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed

#: Bytes of each rank's rows of each block (2 ranks): rows x values per row x 8.
ROW_BYTES = {
    "conv": (2 * 19 * 8, 1 * 19 * 8),
    "fc1": (4 * 49 * 8, 3 * 49 * 8),
    "fc2": (3 * 8 * 8, 2 * 8 * 8),
}
HEADER = 24


def _traffic(rank: int, world: int, strategy: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net().double()
    for layer in (model.conv, model.fc1, model.fc2):
        fully_shard(layer)
    fully_shard(model)
    pre = kaisa.KFACPreconditioner(model, grad_worker_fraction=strategy, damping=0.01,
                                   inv_dtype=torch.float64, lr=0.1, kl_clip=0.05,
                                   layer_kinds=("linear", "conv2d"))
    x, y = _data(world, 0, 4)
    x, y = x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]
    F.cross_entropy(model(x), y).backward()
    # Before any decomposition the workers have no result.
    early = [(e.block.name, None if e.valid is None else bool(e.valid),
              float(e.direction.abs().sum())) for e in pre.curvature.precondition(0.01)]
    stats = pre.communicator.stats
    stats.reset()
    pre.step()  # decomposes, then preconditions
    return {
        "workers": {name: list(pre.placement[name].grad_workers) for name in ROW_BYTES},
        "sent": {k: stats.bytes_sent.get(k, 0) for k in ("gradient_gather", "gradients")},
        "received": {k: stats.bytes_received.get(k, 0) for k in ("gradient_gather",
                                                                 "gradients")},
        "calls": {k: stats.calls.get(k, 0) for k in ("gradient_gather", "gradients")},
        "early": early,
        "refused": _refusals(pre.communicator, rank),
    }


def _refusals(comm: Any, rank: int) -> list[str]:
    errors = []
    for chunks, sizes in (({rank: torch.zeros(8, dtype=torch.uint8)}, {}), ({}, {7: 8})):
        with pytest.raises(ValueError, match="other ranks") as err:
            comm.exchange(chunks, sizes, device=torch.device("cpu"))
        errors.append(str(err.value))
    return errors


def test_mem_opt_gathers_to_the_worker_and_sends_each_rank_its_rows() -> None:
    results = run_distributed(_traffic, 2, "mem_opt", timeout=120.0)
    workers = results[0]["workers"]
    assert all(len(w) == 1 for w in workers.values())
    assert {w[0] for w in workers.values()} == {0, 1}  # both ranks work
    for rank, got in enumerate(results):
        mine = [name for name, w in workers.items() if w == [rank]]
        others = [name for name in ROW_BYTES if name not in mine]
        want_sent = {
            "gradient_gather": sum(ROW_BYTES[n][rank] for n in others),
            "gradients": sum(HEADER + ROW_BYTES[n][1 - rank] for n in mine),
        }
        want_received = {
            "gradient_gather": sum(ROW_BYTES[n][1 - rank] for n in mine),
            "gradients": sum(HEADER + ROW_BYTES[n][rank] for n in others),
        }
        assert got["sent"] == want_sent, rank
        assert got["received"] == want_received, rank
        assert got["calls"] == {"gradient_gather": 3, "gradients": 3}
        # The all-gather + whole-direction broadcast it replaces moved more to this rank.
        whole = {n: sum(ROW_BYTES[n]) for n in ROW_BYTES}
        before = sum(ROW_BYTES[n][1 - rank] for n in ROW_BYTES) + sum(whole[n] for n in others)
        assert sum(want_received.values()) < before
        # No decomposition yet: every rank has an entry per block, marked invalid, zero.
        assert got["early"] == [(n, False, 0.0) for n in ROW_BYTES]
        assert all("other ranks" in e for e in got["refused"])


def test_comm_opt_every_rank_gets_every_row_and_nothing_comes_back() -> None:
    results = run_distributed(_traffic, 2, "comm_opt", timeout=120.0)
    for rank, got in enumerate(results):
        assert got["sent"] == {"gradient_gather": sum(b[rank] for b in ROW_BYTES.values()),
                               "gradients": 0}
        assert got["received"] == {
            "gradient_gather": sum(b[1 - rank] for b in ROW_BYTES.values()), "gradients": 0}
        assert got["calls"] == {"gradient_gather": 3, "gradients": 0}
        assert got["early"] == []  # every rank a worker, none with a result: no entries


def _geometry(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    line = distribute_tensor(torch.zeros(3, 2), init_device_mesh("cpu", (4,)), [Shard(0)])
    hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = distribute_tensor(torch.zeros(5, 2), hsdp_mesh, [Replicate(), Shard(0)])
    for name, t in (("line", line), ("hsdp", hsdp)):
        out[name] = {
            "rows_on": [rows_on(t, r) for r in range(world)],
            "local": local_rows(t),
            "sources": row_sources(t, rank),
        }
    with pytest.raises(ValueError, match="not on the device mesh"):
        rows_on(line, 9)
    with pytest.raises(ValueError, match="dim 0"):
        rows_on(distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (4,)),
                                  [Shard(1)]), 0)
    dist.barrier()
    return out


def test_rows_and_sources_on_a_line_and_an_hsdp_mesh() -> None:
    results = run_distributed(_geometry, 4, timeout=120.0)
    line_rows = [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]  # torch.chunk(3, 4)
    hsdp_rows = [range(0, 3), range(3, 5)] * 2  # mesh [[0, 1], [2, 3]]: shards 0 1 0 1
    for rank, got in enumerate(results):
        assert got["line"]["rows_on"] == line_rows
        assert got["line"]["local"] == line_rows[rank]
        assert got["line"]["sources"] == [(r, line_rows[r]) for r in range(3)]
        assert got["hsdp"]["rows_on"] == hsdp_rows
        assert got["hsdp"]["local"] == hsdp_rows[rank]
        replica = 2 * (rank // 2)  # the ranks of its own replica
        assert got["hsdp"]["sources"] == [(replica, range(0, 3)), (replica + 1, range(3, 5))]


def test_local_communicator_exchange() -> None:
    comm = LocalCommunicator()
    assert comm.exchange({}, {}, device=torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="exchange takes other ranks of 1"):
        comm.exchange({1: torch.zeros(8, dtype=torch.uint8)}, {}, device=torch.device("cpu"))
