"""alpha and beta measured on the current ``torch.distributed`` process group."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kaisa.plan.compute import fit_kernel
from kaisa.plan.network import Link, NetworkSpec

__all__ = ["measure_link", "measured_network"]


def measure_link(*, sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20, 1 << 22),
                 repeats: int = 5, device: str | torch.device = "cpu") -> Link:
    """Fits one alpha-beta link to ring allreduces of the world group (every rank calls it).

    A ring allreduce of ``n`` bytes over ``p`` ranks takes ``2(p-1) alpha + 2(p-1)/p n
    beta``; the line ``t = c0 + c1 n`` through the median times gives ``alpha = c0 /
    (2(p-1))`` and ``beta = c1 p / (2(p-1))``.

    Args:
        sizes: Message sizes in bytes.
        repeats: Timed allreduces per size (the median is kept).
        device: Where the buffers live (CUDA for NCCL).

    Returns:
        The link (every rank gets the same: the times are averaged over ranks).
    """
    p = dist.get_world_size()
    if p < 2:
        raise ValueError("measure_link needs at least two ranks")
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm the connection
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - start)
        median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(median)
        samples.append((float(buf.numel() * 4), float(median.item()) / p))
    fit = fit_kernel(samples)
    alpha = fit.overhead_s / (2 * (p - 1))
    beta = p / (2 * (p - 1) * fit.rate)
    return Link(bandwidth_Bps=1.0 / beta, latency_s=alpha)


def measured_network(**kwargs: object) -> NetworkSpec:
    """A one-level :class:`NetworkSpec` (every rank a node) from :func:`measure_link`."""
    link = measure_link(**kwargs)  # type: ignore[arg-type]
    return NetworkSpec(gpus_per_node=1, intra=link, inter=link, inter_links=1,
                       name="measured on the process group")
