"""alpha and beta measured on a real gloo process group (2 ranks on 127.0.0.1)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.dist import run_distributed


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
