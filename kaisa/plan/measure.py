"""alpha and beta measured on the current ``torch.distributed`` process group."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kaisa.plan.network import Link, NetworkSpec

__all__ = ["fit_link", "measure_link", "measured_network"]


def fit_link(samples: Sequence[tuple[float, float]], world_size: int) -> Link:
    """Fits alpha and beta of a ring allreduce to ``(bytes, seconds)`` samples.

    A ring allreduce of ``n`` bytes over ``p`` ranks takes ``2(p-1) alpha + 2(p-1)/p n
    beta``. The slope of the least-squares line through the samples (absolute error, so
    the largest messages set it) gives ``beta``; its intercept gives ``alpha``, or, where
    noise makes the intercept negative, the smallest message's time less its bytes'
    share. A relative-error fit would let a slow small message (a connection still
    warming up) tilt the line and overstate the bandwidth. Where the times do not grow
    with the size at all (a link so fast that noise hides the per-byte cost, as on
    loopback with small messages), the largest message's time is all counted as
    transfer: a bandwidth that is a lower bound, and alpha 0.

    Args:
        samples: At least two ``(bytes, seconds)`` pairs of different sizes.
        world_size: The ranks of the allreduces (at least 2).

    Returns:
        The link.

    Raises:
        ValueError: With fewer than two sizes or one rank.
    """
    p = world_size
    if p < 2:
        raise ValueError("a link is fitted to allreduces of at least two ranks")
    if len({n for n, _ in samples}) < 2:
        raise ValueError("fit_link needs samples of at least two message sizes")
    k = len(samples)
    mx = sum(n for n, _ in samples) / k
    my = sum(t for _, t in samples) / k
    sxx = sum((n - mx) ** 2 for n, _ in samples)
    slope = sum((n - mx) * (t - my) for n, t in samples) / sxx
    if slope <= 0:
        n1, t1 = max(samples)
        slope, intercept = t1 / n1, 0.0
    else:
        intercept = my - slope * mx
    if intercept < 0:
        n0, t0 = min(samples)
        intercept = max(0.0, t0 - slope * n0)
    return Link(bandwidth_Bps=2 * (p - 1) / (p * slope), latency_s=intercept / (2 * (p - 1)))


def measure_link(*, sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20, 1 << 22),
                 repeats: int = 5, warmup: int = 3,
                 device: str | torch.device = "cpu") -> Link:
    """Fits one alpha-beta link to ring allreduces of the world group (every rank calls it).

    Each size is allreduced ``warmup`` times untimed, then ``repeats`` times after a
    barrier each; the median, averaged over ranks, is one sample of :func:`fit_link`.

    Args:
        sizes: Message sizes in bytes (at least two).
        repeats: Timed allreduces per size (the median is kept).
        warmup: Untimed allreduces per size before them.
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
        for _ in range(warmup):
            dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)
            times.append(time.perf_counter() - start)
        median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(median)
        samples.append((float(buf.numel() * 4), float(median.item()) / p))
    return fit_link(samples, p)


def measured_network(**kwargs: object) -> NetworkSpec:
    """A one-level :class:`NetworkSpec` (every rank a node) from :func:`measure_link`."""
    link = measure_link(**kwargs)  # type: ignore[arg-type]
    return NetworkSpec(gpus_per_node=1, intra=link, inter=link, inter_links=1,
                       name="measured on the process group")
