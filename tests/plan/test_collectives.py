"""The alpha-beta formulas, network specs and kernel fits against hand computations."""

from __future__ import annotations

import pytest

from kaisa.plan import (
    Algorithm,
    Collective,
    Link,
    bucketed_time,
    collective_time,
    fit_kernel,
    link_time,
    parse_network,
)

LINK = Link(bandwidth_Bps=1e6, latency_s=1e-3)  # alpha 1 ms, beta 1 us/byte


@pytest.mark.parametrize(
    ("op", "nbytes", "p", "algorithm", "expected"),
    [
        # ring allreduce 2(p-1)a + 2(p-1)/p n b = 6 ms + 1.5 s
        (Collective.ALLREDUCE, 1e6, 4, Algorithm.RING, 0.006 + 1.5),
        # tree allreduce 2 log2(p) a + 2 n b = 4 ms + 2 s
        (Collective.ALLREDUCE, 1e6, 4, Algorithm.TREE, 0.004 + 2.0),
        (Collective.ALLREDUCE, 1e6, 4, Algorithm.AUTO, 0.006 + 1.5),
        # small message, many ranks: the tree wins (2*3 ms vs 14 ms + 1.75e-5 s)
        (Collective.ALLREDUCE, 10, 8, Algorithm.AUTO, 0.006 + 2e-5),
        # broadcast: chain (p-1)a + n b, binomial log2(p)(a + n b)
        (Collective.BROADCAST, 1e3, 4, Algorithm.RING, 0.003 + 0.001),
        (Collective.BROADCAST, 1e3, 4, Algorithm.TREE, 2 * (0.001 + 0.001)),
        (Collective.BROADCAST, 10, 8, Algorithm.AUTO, 3 * (0.001 + 1e-5)),
        (Collective.BROADCAST, 1e6, 8, Algorithm.AUTO, 0.007 + 1.0),
        (Collective.REDUCE, 1e3, 2, Algorithm.RING, 0.001 + 0.001),
        # all-to-all (p-1)(a + n b / p)
        (Collective.ALL_TO_ALL, 4e6, 4, Algorithm.AUTO, 3 * (0.001 + 1.0)),
        # non-power-of-two: ceil(log2 6) = 3
        (Collective.BROADCAST, 1e3, 6, Algorithm.TREE, 3 * (0.001 + 0.001)),
    ],
)
def test_alpha_beta_formulas(op: Collective, nbytes: float, p: int, algorithm: Algorithm,
                             expected: float) -> None:
    assert link_time(op, nbytes, p, LINK, algorithm) == pytest.approx(expected, rel=1e-12)


def test_one_rank_and_empty_messages_cost_nothing() -> None:
    for op in Collective:
        assert link_time(op, 1e6, 1, LINK) == 0.0
        assert link_time(op, 0, 8, LINK) == 0.0


def test_buckets_pay_alpha_per_bucket() -> None:
    net = parse_network("1x1MB/s@1ms")
    ranks = (0, 1)
    one = collective_time(Collective.ALLREDUCE, 1e6, ranks, net)
    half = collective_time(Collective.ALLREDUCE, 5e5, ranks, net)
    assert bucketed_time(Collective.ALLREDUCE, 2.5e6, ranks, net, 1e6) == pytest.approx(
        2 * one + half)
    assert bucketed_time(Collective.ALLREDUCE, 2.5e6, ranks, net, 0) == pytest.approx(
        collective_time(Collective.ALLREDUCE, 2.5e6, ranks, net))


def test_network_spec_and_presets() -> None:
    net = parse_network("8x900GB/s,4x200Gb/s@3us")
    assert net.gpus_per_node == 8 and net.inter_links == 4
    assert net.intra.bandwidth_Bps == 900e9 and net.intra.latency_s == 2e-6  # default alpha
    assert net.inter.bandwidth_Bps == 25e9 and net.inter.latency_s == pytest.approx(3e-6)
    # a group inside a node sees NVLink
    assert net.group_link(tuple(range(8))) == net.intra
    # one member a node: 8 such groups share the node's 4 x 25 GB/s
    assert net.group_link((0, 8, 16)).bandwidth_Bps == pytest.approx(100e9 / 8)
    # every rank of two nodes: the whole NIC bandwidth
    assert net.group_link(tuple(range(16))).bandwidth_Bps == pytest.approx(100e9)
    assert net.group_link((0, 8)).latency_s == pytest.approx(3e-6)
    flat = parse_network("1x10Gb/s@50us")
    assert flat.gpus_per_node == 1 and flat.inter.bandwidth_Bps == pytest.approx(1.25e9)
    assert flat.group_link((0, 1)).latency_s == pytest.approx(50e-6)
    assert parse_network("a100-ib").gpus_per_node == 8
    with pytest.raises(ValueError, match="cannot read"):
        parse_network("8 GPUs")


def test_kernel_fit_recovers_a_line() -> None:
    samples = [(w, 1e-4 + w / 5e9) for w in (1e6, 1e7, 1e8, 1e9)]
    fit = fit_kernel(samples)
    assert fit.overhead_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.rate == pytest.approx(5e9, rel=1e-6)
    through_origin = fit_kernel([(1e6, 2e-3)])
    assert through_origin.overhead_s == 0 and through_origin.rate == pytest.approx(5e8)


def test_kernel_fit_reproduces_its_measurements_and_extrapolates_at_its_rate() -> None:
    samples = [(1e6, 1e-3), (8e6, 2e-3), (6.4e7, 3e-2)]  # not a line: a cache knee
    fit = fit_kernel(samples)
    for work, seconds in samples:
        assert fit.time(work) == pytest.approx(seconds)
    assert 2e-3 < fit.time(2e7) < 3e-2
    assert fit.time(1.28e8) == pytest.approx(3e-2 + 6.4e7 / fit.rate)
    assert fit.time(1e3) >= fit.overhead_s
