"""Unit tests of kaisa.distributed: grid, placement, memory model, communicator."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kaisa.distributed import (
    DistributedStrategy,
    LocalCommunicator,
    TorchDistCommunicator,
    WorkerGrid,
    choose_fraction,
    estimate_memory,
    make_communicator,
    pack_symmetric,
    packed_numel,
    place_layers,
    resolve_grad_workers,
    strategy_fraction,
    unpack_symmetric,
    valid_fractions,
)
from tests.support.dist import run_distributed

# ----------------------------------------------------------------------------
# Strategy / grid
# ----------------------------------------------------------------------------


def test_strategy_fractions() -> None:
    assert resolve_grad_workers(DistributedStrategy.COMM_OPT, 4) == 4
    assert resolve_grad_workers(DistributedStrategy.MEM_OPT, 4) == 1
    assert resolve_grad_workers(DistributedStrategy.HYBRID_OPT, 4) == 2
    assert resolve_grad_workers(DistributedStrategy.HYBRID_OPT, 1) == 1
    assert resolve_grad_workers("hybrid_opt", 8) == 4
    assert resolve_grad_workers(0.25, 8) == 2
    assert resolve_grad_workers(1, 3) == 3
    assert resolve_grad_workers(1 / 3, 3) == 1
    assert valid_fractions(4) == [Fraction(1), Fraction(1, 2), Fraction(1, 4)]


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, float("nan")])
def test_fraction_out_of_range(bad: float) -> None:
    with pytest.raises(ValueError, match="valid fractions"):
        resolve_grad_workers(bad, 4)


def test_fraction_not_dividing_world() -> None:
    with pytest.raises(ValueError, match=r"valid fractions for world size 6: 1, 0.5"):
        resolve_grad_workers(0.25, 6)
    with pytest.raises(ValueError, match="must be a whole number dividing"):
        resolve_grad_workers(strategy_fraction(DistributedStrategy.HYBRID_OPT, 3), 3)
    with pytest.raises(ValueError, match="'auto' must be resolved"):
        resolve_grad_workers("auto", 4)
    with pytest.raises(ValueError, match="is not valid"):
        resolve_grad_workers("fast", 4)
    with pytest.raises(TypeError):
        resolve_grad_workers(True, 4)


def test_grid_layout() -> None:
    grid = WorkerGrid.from_fraction(0.5, 4)
    assert grid.worker_groups() == [(0, 1), (2, 3)]
    assert grid.receiver_groups() == [(0, 2), (1, 3)]
    assert grid.strategy_name == "HYBRID-OPT"
    assert WorkerGrid.from_fraction("mem-opt", 4).worker_groups() == [(0,), (1,), (2,), (3,)]
    assert WorkerGrid.from_fraction(DistributedStrategy.MEM_OPT, 4).receiver_groups() == [
        (0, 1, 2, 3)
    ]
    comm = WorkerGrid.from_fraction(DistributedStrategy.COMM_OPT, 4)
    assert comm.worker_groups() == [(0, 1, 2, 3)]
    assert comm.receiver_groups() == [(0,), (1,), (2,), (3,)]
    g8 = WorkerGrid(8, 2)
    assert g8.worker_group_of(5) == 2 and g8.receiver_group_of(5) == 1


# ----------------------------------------------------------------------------
# Placement
# ----------------------------------------------------------------------------

DIMS = {"l0": (28, 64), "l1": (65, 64), "l2": (65, 32), "l3": (33, 10), "l4": (300, 5)}


def test_lpt_placement_mem_opt() -> None:
    p = place_layers(DIMS, WorkerGrid(4, 1))
    # Largest first: l4 (300^3) -> rank 0, l1 -> 1, l2 -> 2, l0 -> 3, l3 -> least loaded.
    assert p["l4"].a_rank == p["l4"].g_rank == 0
    assert p["l1"].a_rank == 1 and p["l2"].a_rank == 2 and p["l0"].a_rank == 3
    assert p["l3"].a_rank == 3  # rank 3 holds l0 (smallest load so far)
    assert p["l4"].grad_workers == (0,)
    assert p["l4"].grad_receivers == {0: (1, 2, 3)}
    assert p.held_by(0) == ["l4"]
    assert list(p.layers) == list(DIMS)  # model order preserved
    text = p.describe()
    assert "MEM-OPT" in text and "l4" in text and "0->[1, 2, 3]" in text


def test_lpt_placement_hybrid_and_separate_factors() -> None:
    p = place_layers(DIMS, WorkerGrid(4, 2), colocate_factors=False)
    for lp in p.layers.values():
        assert lp.a_rank != lp.g_rank
        assert lp.a_rank in lp.grad_workers and lp.g_rank in lp.grad_workers
        for w, recv in lp.grad_receivers.items():
            assert len(recv) == 1 and recv[0] % 2 == w % 2 and recv[0] not in lp.grad_workers
    assert p["l4"].worker_group == 0 and p["l1"].worker_group == 1
    assert p["l4"].grad_source(3) == 1


def test_lpt_memory_strategy_and_comm_opt() -> None:
    p = place_layers(DIMS, WorkerGrid(2, 2), assignment_strategy="memory")
    assert all(lp.grad_workers == (0, 1) for lp in p.layers.values())
    assert all(not any(lp.grad_receivers.values()) for lp in p.layers.values())
    loads = p.loads
    assert sum(loads) == sum(a * a + g * g for a, g in DIMS.values())
    with pytest.raises(ValueError, match="assignment_strategy"):
        place_layers(DIMS, WorkerGrid(2, 2), assignment_strategy="speed")


def test_fewer_layers_than_ranks() -> None:
    p = place_layers({"only": (10, 4)}, WorkerGrid(4, 1))
    assert p["only"].a_rank == 0
    assert p.computed_by(3) == []


# ----------------------------------------------------------------------------
# Memory model
# ----------------------------------------------------------------------------


def test_memory_model_reflects_strategy() -> None:
    comm = estimate_memory(DIMS, WorkerGrid(4, 4))
    mem = estimate_memory(DIMS, WorkerGrid(4, 1))
    assert comm.per_rank[0]["factors"] == mem.per_rank[0]["factors"]
    comm_dec = max(r["decompositions"] for r in comm.per_rank)
    mem_dec = max(r["decompositions"] for r in mem.per_rank)
    assert mem_dec < comm_dec
    for est in (comm, mem):
        assert all(r["total"] == r["factors"] + r["decompositions"]
                   + max(r["buffers"], r["step_buffers"]) for r in est.per_rank)


# The gradient matrices' elements of DIMS: sum of a * g.
GRAD_NUMEL = 28 * 64 + 65 * 64 + 65 * 32 + 33 * 10 + 300 * 5


def test_memory_model_step_term() -> None:
    """The peak inside step() per path (kaisa.distributed.step_buffers), float32.

    COMM-OPT on 4 ranks: every rank preconditions every layer and sends it to no one, the
    grouped path: gradient stack, preconditioned stack and KL products of every layer (two
    without a KL clip: the scaling and the choice are computed in the preconditioned stack). MEM-OPT: every layer is sent or
    received: its buffer and the bucket copy or where output (each with a flag), plus one
    block's transient, the largest layer (l1, 65 x 64). Nothing after the backward pass.
    """
    comm = estimate_memory(DIMS, WorkerGrid(4, 4))
    mem = estimate_memory(DIMS, WorkerGrid(4, 1))
    plain = estimate_memory(DIMS, WorkerGrid(4, 4), kl_clip=False)
    for r in comm.per_rank:
        assert (r["buffers"], r["step_buffers"]) == (0, 4 * 3 * GRAD_NUMEL)
    assert all(r["step_buffers"] == 4 * 2 * GRAD_NUMEL for r in plain.per_rank)
    assert all(r["step_buffers"] == 4 * (2 * GRAD_NUMEL + 2 * len(DIMS) + 65 * 64)
               for r in mem.per_rank)
    assert mem.per_rank[0]["buffers"] == 0


def test_memory_model_step_term_owned_factors() -> None:
    """FSDP2 on 2 ranks: nothing after the backward pass (the holders folded the averaged
    batch factors as they arrived); inside step() the sharded path: two copies of the
    rank's share of every layer's gradient (``ceil(numel / 2)``) plus one layer's
    transient, the largest (l1, 65 x 64)."""
    est = estimate_memory(DIMS, WorkerGrid(2, 2), owned_factors=True)
    share = sum(-(-a * g // 2) for a, g in DIMS.values())
    for r in est.per_rank:
        assert r["buffers"] == 0
        assert r["step_buffers"] == 4 * (2 * share + 65 * 64)
        assert r["total"] == r["factors"] + r["decompositions"] + r["step_buffers"]

def test_memory_model_owned_factors() -> None:
    """Under FSDP2 a layer's factors count on the rank that decomposes it only: together
    the ranks hold DDP's per-rank factors once."""
    for world in (2, 4):
        ddp = estimate_memory(DIMS, WorkerGrid(world, 1))
        owned = estimate_memory(DIMS, WorkerGrid(world, 1), owned_factors=True)
        full = ddp.per_rank[0]["factors"]
        assert all(r["factors"] == full for r in ddp.per_rank)
        assert sum(r["factors"] for r in owned.per_rank) == full
        assert max(r["factors"] for r in owned.per_rank) < full
        assert [r["decompositions"] for r in owned.per_rank] == [
            r["decompositions"] for r in ddp.per_rank]


def test_choose_fraction() -> None:
    comm = estimate_memory(DIMS, WorkerGrid(4, 4))
    mem = estimate_memory(DIMS, WorkerGrid(4, 1))
    big = choose_fraction(DIMS, 4, comm.max_total_mb * 1.01)
    assert big.fraction == 1
    mid = choose_fraction(DIMS, 4, (comm.max_total_mb + mem.max_total_mb) / 2)
    assert mid.fraction < 1
    with pytest.raises(ValueError, match="no grad_worker_fraction fits"):
        choose_fraction(DIMS, 4, mem.max_total_mb * 0.5)


# ----------------------------------------------------------------------------
# Symmetric packing / local communicator
# ----------------------------------------------------------------------------


def test_symmetric_pack_roundtrip() -> None:
    x = torch.randn(3, 5, 5, dtype=torch.float64)
    s = x + x.transpose(-1, -2)
    p = pack_symmetric(s)
    assert p.shape == (3, 15)
    assert packed_numel((3, 5, 5), True) == 45 and packed_numel((3, 5, 5), False) == 75
    torch.testing.assert_close(unpack_symmetric(p, 5), s, rtol=0, atol=0)
    out = torch.empty_like(s)
    unpack_symmetric(p[1], 5, out=out[1])
    torch.testing.assert_close(out[1], s[1], rtol=0, atol=0)
    with pytest.raises(ValueError):
        pack_symmetric(torch.zeros(3, 4))


def test_local_communicator_is_noop() -> None:
    comm = make_communicator()
    assert isinstance(comm, LocalCommunicator)
    t = torch.randn(4, 4)
    assert comm.allreduce_mean(t, symmetric=True).wait() is t
    assert comm.allreduce_mean_(t, symmetric=True).wait() is t
    assert comm.reduce_mean(t, 0, symmetric=True).wait() is t
    with pytest.raises(ValueError, match="reduce destination 1 is not a rank < 1"):
        comm.reduce_mean(t, 1)
    assert comm.broadcast(t, 0, [0]).wait() is t
    with pytest.raises(ValueError, match="rank 0 only"):
        comm.broadcast(t, 0, [0, 1])
    with pytest.raises(ValueError, match="source 1 is not in group"):
        comm.broadcast(t, 1, [0])
    comm.flush()
    comm.wait_all()
    assert comm.stats.bytes_sent == {}


# ----------------------------------------------------------------------------
# TorchDistCommunicator on spawned gloo ranks
# ----------------------------------------------------------------------------


def _comm_job(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    grid = WorkerGrid(world, 2 if world == 4 else 1)
    groups = grid.worker_groups() + grid.receiver_groups()
    out: dict[str, object] = {}
    for cap in (0.0, 0.0005, 25.0):
        comm = TorchDistCommunicator(groups, bucket_cap_mb=cap)
        assert isinstance(make_communicator(), TorchDistCommunicator)
        # Rank-dependent symmetric factors, batched and not, in two dtypes.
        mats = []
        for i, n in enumerate((3, 7, 20, 1)):
            gen = torch.Generator().manual_seed(100 * rank + i)
            x = torch.randn(n + 2, n, generator=gen, dtype=torch.float64)
            mats.append(x.T @ x)
        batched = torch.stack([mats[1], 2 * mats[1]])
        vec = torch.arange(5, dtype=torch.float32) * (rank + 1)
        handles = [comm.allreduce_mean(m, symmetric=True) for m in mats]
        hb = comm.allreduce_mean(batched, symmetric=True)
        hv = comm.allreduce_mean(vec)
        hn = comm.allreduce_mean(mats[2], symmetric=False)
        comm.flush()
        got = [h.wait() for h in handles]
        # Reference: plain per-tensor all_reduce.
        for m, g in zip(mats, got, strict=True):
            ref = m.clone()
            torch.distributed.all_reduce(ref)
            torch.testing.assert_close(g, ref / world, rtol=1e-12, atol=1e-12)
            assert torch.equal(g, g.T)
        ref_b = batched.clone()
        torch.distributed.all_reduce(ref_b)
        torch.testing.assert_close(hb.wait(), ref_b / world, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            hv.wait(), torch.arange(5, dtype=torch.float32) * (world + 1) / 2
        )
        ref_n = mats[2].clone()
        torch.distributed.all_reduce(ref_n)
        torch.testing.assert_close(hn.wait(), ref_n / world, rtol=1e-12, atol=1e-12)
        comm.wait_all()
        sent = comm.stats.bytes_sent["factors"]
        sym = sum(packed_numel(m.shape, True) for m in mats) + packed_numel(batched.shape, True)
        expected = (sym + 400) * 8 + 5 * 4
        assert sent == expected, (sent, expected)
        out[f"calls_{cap}"] = comm.stats.calls["factors"]

        # Broadcasts within worker groups and receiver groups, fused per (src, group).
        results = []
        for gi, group in enumerate(groups):
            src = group[-1]
            for j, n in enumerate((4, 9)):
                if rank == src:
                    data = torch.full((n, n), float(10 * gi + j), dtype=torch.float64)
                    data = data + torch.eye(n, dtype=torch.float64)
                else:
                    data = torch.zeros(n, n, dtype=torch.float64)
                h = comm.broadcast(data, src, group, symmetric=(j == 0), kind="decompositions")
                results.append((gi, j, n, group, data, h))
            grad = torch.full((3, 2), float(rank), dtype=torch.float32)
            results.append((gi, 9, 0, group, grad, comm.broadcast(grad, src, group, kind="grad")))
        comm.flush()
        for gi, j, n, group, data, h in results:
            res = h.wait()
            assert res is data
            if rank not in group:
                continue
            if j == 9:
                assert torch.all(res == float(group[-1]))
            else:
                ref = torch.full((n, n), float(10 * gi + j), dtype=torch.float64) + torch.eye(
                    n, dtype=torch.float64
                )
                assert torch.equal(res, ref)
        comm.wait_all()
        out[f"bcast_sent_{cap}"] = comm.stats.bytes_sent.get("decompositions", 0)
    with pytest.raises(ValueError, match="not registered"):
        comm.broadcast(torch.zeros(1), 0, [0, 3] if world == 4 else [0, 5])
    out["reduce_calls"] = _reduce_job(rank, world)
    out["in_place"] = _in_place_job(rank, world)
    return out


def _in_place_job(rank: int, world: int) -> list[int]:
    """``allreduce_mean_``: the mean written into each input, at most two buckets in flight.

    A contiguous tensor alone in its bucket (larger than the capacity) is reduced where it
    is (no copy); the others (small ones fused, a symmetric one) are written back from the
    bucket copy. Returns the in-flight counts seen after each call.
    """
    comm = TorchDistCommunicator(bucket_cap_mb=0.0005)  # 524 bytes: 65 float64 elements
    tensors, refs, in_flight = [], [], []
    for i, (n, symmetric) in enumerate([(3, True), (2, False), (12, False), (9, True),
                                        (2, False), (3, False), (15, False)]):
        gen = torch.Generator().manual_seed(100 * rank + i)
        x = torch.randn(n + 2, n, generator=gen, dtype=torch.float64)
        t = x.T @ x
        ref = t.clone()
        torch.distributed.all_reduce(ref)
        tensors.append((t, t.data_ptr(), comm.allreduce_mean_(t, symmetric=symmetric)))
        refs.append(ref / world)
        in_flight.append(len([b for b in comm._in_place if not b.finished]))
    comm.flush()
    in_flight.append(len([b for b in comm._in_place if not b.finished]))
    alone = [b for b in comm._in_place if len(b.entries) == 1 and not b.entries[0].symmetric]
    assert alone and all(b.flat is not None and b.entries[0].tensor is not None and
                         b.flat.data_ptr() == b.entries[0].tensor.data_ptr() for b in alone)
    for (t, ptr, handle), ref in zip(tensors, refs, strict=True):
        assert handle.wait() is t and t.data_ptr() == ptr  # in place
        torch.testing.assert_close(t, ref, rtol=1e-12, atol=1e-12)
    comm.wait_all()
    assert not [b for b in comm._in_place if not b.finished]
    return in_flight


def _reduce_job(rank: int, world: int) -> int:
    """``reduce_mean`` to each rank in turn, fused per destination: the mean on it only."""
    comm = TorchDistCommunicator(bucket_cap_mb=25.0)
    pending = []
    for dst in range(world):
        for symmetric in (True, False):
            gen = torch.Generator().manual_seed(10 * rank + dst)
            x = torch.randn(6, 4, generator=gen, dtype=torch.float64)
            m = torch.stack([x.T @ x, 2 * x.T @ x])
            pending.append((dst, m, comm.reduce_mean(m, dst, symmetric=symmetric)))
    comm.flush()
    for dst, m, handle in pending:
        got = handle.wait()
        ref = m.clone()
        torch.distributed.all_reduce(ref)
        if rank == dst:
            torch.testing.assert_close(got, ref / world, rtol=1e-12, atol=1e-12)
        else:
            assert got.numel() == 0  # its contribution was released when sent
    comm.wait_all()
    with pytest.raises(ValueError, match="destination"):
        comm.reduce_mean(torch.zeros(1), world)
    return comm.stats.calls["factors"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_torch_dist_communicator(world: int) -> None:
    results = run_distributed(_comm_job, world, timeout=100)
    r0 = results[0]
    # Fusion: one collective per tensor without buckets, fewer with them.
    assert r0["calls_0.0"] == 7
    assert r0["calls_25.0"] == 2  # one bucket per dtype
    assert 2 < r0["calls_0.0005"] < 7
    assert all(r["reduce_calls"] == world for r in results)  # one bucket per destination
    assert max(max(r["in_place"]) for r in results) == 2  # never more than two in flight
