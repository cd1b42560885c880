"""alpha and beta measured on a real gloo process group (2 ranks on 127.0.0.1)."""

from __future__ import annotations

from typing import Any

import pytest

from kaisa.plan import Link, fit_link
from tests.support.dist import run_distributed

SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def _ring(link: Link, p: int, n: float) -> float:
    return 2 * (p - 1) * link.latency_s + 2 * (p - 1) / p * n * link.beta


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_fit_link_recovers_alpha_and_beta_of_exact_ring_times(p: int) -> None:
    true = Link(bandwidth_Bps=25e6, latency_s=300e-6)
    fit = fit_link([(float(n), _ring(true, p, n)) for n in SIZES], p)
    assert fit.bandwidth_Bps == pytest.approx(true.bandwidth_Bps, rel=1e-9)
    assert fit.latency_s == pytest.approx(true.latency_s, rel=1e-6)


def test_fit_link_bandwidth_survives_a_slow_small_message() -> None:
    # A first allreduce still warming up the connection: 1 KiB slower than 16 KiB.
    true = Link(bandwidth_Bps=25e6, latency_s=300e-6)
    samples = [(float(n), _ring(true, 2, n)) for n in SIZES]
    samples[0] = (samples[0][0], 2.3e-3)
    fit = fit_link(samples, 2)
    assert fit.bandwidth_Bps == pytest.approx(true.bandwidth_Bps, rel=0.01)
    assert 0 <= fit.latency_s < 2.3e-3


def test_fit_link_negative_intercept_falls_back_to_the_smallest_message() -> None:
    # Times slightly below the line at the small end: the intercept comes out negative.
    samples = [(1e3, 1e-5), (1e6, 0.04), (4e6, 0.16)]
    fit = fit_link(samples, 2)
    assert fit.latency_s >= 0
    assert fit.bandwidth_Bps == pytest.approx(1 / (0.16 - 0.04) * 3e6, rel=0.01)


def test_fit_link_times_that_do_not_grow_count_the_largest_message_as_transfer() -> None:
    # Loopback, small messages: 64 KiB slower than 1 MiB (noise hides the per-byte cost).
    samples = [(1024.0, 6.6e-4), (65536.0, 3.2e-3), (1048576.0, 1.8e-3)]
    fit = fit_link(samples, 2)
    assert fit.latency_s == 0.0
    assert fit.bandwidth_Bps == pytest.approx(1048576.0 / 1.8e-3)  # p = 2: n beta


@pytest.mark.parametrize("samples,p,match", [
    ([(1e3, 1e-3), (1e6, 2e-3)], 1, "two ranks"),
    ([(1e6, 1e-3), (1e6, 2e-3)], 2, "two message sizes"),
])
def test_fit_link_rejects_what_it_cannot_fit(samples: list[tuple[float, float]], p: int,
                                             match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit_link(samples, p)


def _measure_job(rank: int, world: int) -> dict[str, Any]:
    from kaisa.plan import measured_network

    net = measured_network(sizes=(1 << 10, 1 << 16, 1 << 20), repeats=3)
    return {"bandwidth": net.inter.bandwidth_Bps, "latency": net.inter.latency_s,
            "gpus_per_node": net.gpus_per_node}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_measured_link_is_physical_and_the_same_on_every_rank() -> None:
    results = run_distributed(_measure_job, 2, timeout=100)
    assert results[0] == results[1]  # the times are averaged over ranks
    assert results[0]["bandwidth"] > 1e6 and 0 <= results[0]["latency"] < 1.0
    assert results[0]["gpus_per_node"] == 1
