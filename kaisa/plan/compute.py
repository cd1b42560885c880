"""What K-FAC's compute costs on one device: fitted from timings, or read from a profile.

Three kernels are fitted, each as ``t = overhead + work / rate`` (weighted least squares
on relative error, coefficients kept non-negative):

* ``covariance``: a factor from ``rows`` rows of width ``n``, ``2 rows n^2`` flops;
* ``precondition``: an eigen-basis preconditioning of a ``g x a`` gradient, four
  GEMMs, ``4 a g (a + g)`` flops;
* ``eigh``: one symmetric eigendecomposition of size ``n``, ``n^3`` work units.

A :class:`ComputeProfile` comes from a short microbenchmark on this device
(:func:`microbenchmark`), from the GPU script's result JSON (``bench/gpu/schema.py``:
its ``kernels`` stage), or from a JSON this module wrote (:meth:`ComputeProfile.to_json`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ComputeProfile", "KernelFit", "fit_kernel", "load_profile", "microbenchmark"]


@dataclass(frozen=True, kw_only=True)
class KernelFit:
    """``t = overhead_s + work / rate``, or the measured points themselves.

    With ``points`` (``(work, seconds)`` pairs, sorted by work) a time inside their range
    is interpolated linearly in log-log space (so every measured size is reproduced) and
    one outside it is extrapolated from the nearest point at the fitted rate; without
    them the line is used.

    Attributes:
        overhead_s: Seconds per call.
        rate: Work units per second (flops for GEMMs, ``n^3`` units for ``eigh``).
        points: The measurements the fit came from (may be empty).
    """

    overhead_s: float
    rate: float
    points: tuple[tuple[float, float], ...] = ()

    def time(self, work: float) -> float:
        """Seconds of one call doing ``work`` units."""
        pts = self.points
        if len(pts) < 2 or work <= 0:
            return self.overhead_s + max(work, 0.0) / self.rate
        if work <= pts[0][0]:
            return max(self.overhead_s, pts[0][1] - (pts[0][0] - work) / self.rate)
        if work >= pts[-1][0]:
            return pts[-1][1] + (work - pts[-1][0]) / self.rate
        for (w0, t0), (w1, t1) in itertools.pairwise(pts):
            if w0 <= work <= w1:
                x = (math.log(work) - math.log(w0)) / (math.log(w1) - math.log(w0))
                return math.exp(math.log(t0) + x * (math.log(t1) - math.log(t0)))
        return self.overhead_s + work / self.rate  # unreachable: the points are sorted


def fit_kernel(samples: Sequence[tuple[float, float]]) -> KernelFit:
    """Fits ``t = c0 + c1 work`` to ``(work, seconds)`` samples, minimising relative error.

    Args:
        samples: At least one ``(work, seconds)`` pair.

    Returns:
        The fit; with one sample, or a negative intercept, the line through the origin.
    """
    if not samples:
        raise ValueError("fit_kernel needs samples")
    ws = [1.0 / (t * t) for _, t in samples]
    sw = sum(ws)
    sx = sum(w * x for w, (x, _) in zip(ws, samples, strict=True))
    sy = sum(w * y for w, (_, y) in zip(ws, samples, strict=True))
    sxx = sum(w * x * x for w, (x, _) in zip(ws, samples, strict=True))
    sxy = sum(w * x * y for w, (x, y) in zip(ws, samples, strict=True))
    det = sw * sxx - sx * sx
    c0, c1 = -1.0, 0.0
    if len(samples) > 1 and det > 0:
        c1 = (sw * sxy - sx * sy) / det
        c0 = (sy - c1 * sx) / sw
    if c0 < 0 or c1 <= 0:
        c0 = 0.0
        c1 = sxy / sxx if sxx > 0 else 0.0
    points = tuple(sorted((float(w), float(t)) for w, t in samples if w > 0 and t > 0))
    return KernelFit(overhead_s=c0, rate=1.0 / c1 if c1 > 0 else float("inf"),
                     points=points)


@dataclass(frozen=True, kw_only=True)
class ComputeProfile:
    """Fitted K-FAC kernel costs on one device.

    Attributes:
        device: What was timed.
        source: Where the numbers come from (a file, ``microbenchmark``).
        covariance: The factor GEMM (work: ``2 rows n^2`` flops).
        precondition: The eigen preconditioning (work: ``4 a g (a + g)`` flops).
        eigh: One eigendecomposition (work: ``n^3``).
        step_s: A measured first-order iteration (forward, backward, optimizer), if known.
    """

    device: str
    source: str
    covariance: KernelFit
    precondition: KernelFit
    eigh: KernelFit
    step_s: float | None = None

    def covariance_s(self, rows: int, n: int) -> float:
        """Seconds of one ``n x n`` factor from ``rows`` rows."""
        return self.covariance.time(2.0 * rows * n * n)

    def precondition_s(self, a_dim: int, g_dim: int) -> float:
        """Seconds of preconditioning one ``g x a`` gradient in the eigenbasis."""
        return self.precondition.time(4.0 * a_dim * g_dim * (a_dim + g_dim))

    def eigh_s(self, n: int, count: int = 1) -> float:
        """Seconds of one batched call decomposing ``count`` matrices of size ``n``."""
        return self.eigh.time(count * float(n) ** 3)

    def gemm_s(self, flops: float) -> float:
        """Seconds of ``flops`` of large GEMMs (the covariance rate, no overhead)."""
        return flops / self.covariance.rate

    def to_json(self) -> dict[str, Any]:
        """The profile as JSON-ready data (:meth:`from_json` reads it back)."""
        return {"kaisa_plan_profile": 1, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str | None = None) -> ComputeProfile:
        """The profile :meth:`to_json` wrote."""
        fits = {k: KernelFit(overhead_s=data[k]["overhead_s"], rate=data[k]["rate"],
                             points=tuple((float(w), float(t))
                                          for w, t in data[k].get("points", ())))
                for k in ("covariance", "precondition", "eigh")}
        return cls(device=data["device"], source=source or data.get("source", "?"),
                   step_s=data.get("step_s"), **fits)


_EIGH = re.compile(r"^n(\d+)-b(\d+)-float32$")
_PRECOND = re.compile(r"^m(\d+)-n(\d+)-b(\d+)-da_dg$")
_COV = re.compile(r"^(\d+)x(\d+)$")


def _from_gpu_script(data: dict[str, Any], source: str) -> ComputeProfile:
    kernels = data.get("stages", {}).get("kernels", {})
    results = (kernels.get("detail") or {}).get("results") or {}
    if kernels.get("status") != "passed" or not results:
        raise ValueError(f"{source}: the GPU script's kernels stage did not pass; no timings")
    eigh, pre, cov = [], [], []
    for key, row in results.get("eigh", {}).items():
        if (m := _EIGH.match(key)) is not None:
            n, b = int(m[1]), int(m[2])
            eigh.append((float(b * n**3), row["ms"]["kaisa"] / 1e3))
    for key, row in results.get("precondition", {}).items():
        if (m := _PRECOND.match(key)) is not None:
            g, a, b = int(m[1]), int(m[2]), int(m[3])
            pre.append((4.0 * b * a * g * (a + g), row["ms"]["kaisa"] / 1e3))
    for key, row in results.get("covariance", {}).items():
        if (m := _COV.match(key)) is not None:
            rows, n = int(m[1]), int(m[2])
            cov.append((2.0 * rows * n * n, row["ms"]["kaisa"] / 1e3))
    if not (eigh and pre and cov):
        raise ValueError(f"{source}: the kernels stage lacks eigh, precondition or covariance")
    return ComputeProfile(device=str(data.get("device", "?")), source=source,
                          covariance=fit_kernel(cov), precondition=fit_kernel(pre),
                          eigh=fit_kernel(eigh))


def load_profile(path: str | Path) -> ComputeProfile:
    """Reads a profile: the GPU script's result JSON or one :meth:`ComputeProfile.to_json` wrote.

    Args:
        path: The JSON file.

    Returns:
        The profile.

    Raises:
        ValueError: If the file holds neither.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if "kaisa_plan_profile" in data:
        return ComputeProfile.from_json(data, str(path))
    return _from_gpu_script(data, str(path))


#: Operands a kernel is timed on are cycled through copies totalling at least this many
#: bytes (beyond a last-level cache), so each call meets its operands cold, as a step
#: that runs every block's kernel once does.
_COLD_BYTES = 64 * 1024 * 1024
_MAX_COPIES = 64


def _cold(fn: Callable[..., object], *operands: torch.Tensor) -> Callable[[], object]:
    """``fn`` on the next of enough copies of ``operands`` to exceed :data:`_COLD_BYTES`."""
    nbytes = sum(t.numel() * t.element_size() for t in operands)
    count = min(_MAX_COPIES, max(1, -(-_COLD_BYTES // max(nbytes, 1))))
    copies = itertools.cycle([operands] + [tuple(t.clone() for t in operands)
                                           for _ in range(count - 1)])
    return lambda: fn(*next(copies))


def _best_time(fn: Callable[[], object], sync: Callable[[], None], repeats: int,
               shared: bool = False) -> float:
    """Seconds of one call after a warm-up.

    The median of ``repeats`` timed calls; with ``shared``, the mean of ``repeats``
    back-to-back calls timed as one block.
    """
    fn()
    sync()
    if shared:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return (time.perf_counter() - start) / repeats
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def microbenchmark(device: str | torch.device = "cpu", *, quick: bool = True,
                   repeats: int = 5, shared: bool = False) -> ComputeProfile:
    """Times kaisa's three kernels at a few sizes on ``device`` and fits them.

    The kernels are the ones a step runs: :func:`kaisa.ops.covariance`,
    :func:`kaisa.methods.linalg.eigen_decompositions` (its size-grouped ``eigh`` with the
    fallback ladder) and :func:`kaisa.ops.eigen_precondition`.

    Args:
        device: Where to time.
        quick: Small sizes only (about a second on a CPU core).
        repeats: Timed calls per size (the median is kept).
        shared: Time the calls back to back as one block and keep their mean: on a
            CPU that runs more processes than it has cores, the calls that the
            scheduler preempts are then in the rate (a median keeps the ones that ran
            alone). For ranks that share the device, all calling at once.

    Returns:
        The fitted profile.
    """
    dev = torch.device(device)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None))
    from kaisa import ops
    from kaisa.methods import linalg

    sizes = (64, 128, 256, 384) if quick else (128, 256, 512, 1024, 2048)
    gen = torch.Generator(device="cpu").manual_seed(0)
    cov, pre, eig = [], [], []
    for n in sizes:
        rows = 4 * n
        x = torch.randn(rows, n, generator=gen).to(dev)
        s = ops.covariance(x, 1.0 / rows) + torch.eye(n, device=dev)
        eigen = linalg.eigen_decompositions([s.unsqueeze(0)], inv_dtype=torch.float32)[0]
        assert eigen is not None
        q, d = eigen.eigenvectors, eigen.eigenvalues
        g = torch.randn(1, n, n, generator=gen).to(dev)
        dgda = 1.0 / (d.unsqueeze(-1) * d.unsqueeze(-2) + 1e-3)
        cov.append((2.0 * rows * n * n, _best_time(
            _cold(lambda m: ops.covariance(m, 1.0 / rows), x),  # noqa: B023 (called here)
            sync, repeats, shared)))
        pre.append((8.0 * n**3, _best_time(
            _cold(lambda g, q, dgda: ops.eigen_precondition(g, q, q, dgda=dgda), g, q, dgda),
            sync, repeats, shared)))
        eig.append((float(n) ** 3, _best_time(
            _cold(lambda m: linalg.eigen_decompositions([m], inv_dtype=torch.float32),
                  s.unsqueeze(0)), sync, repeats, shared)))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} "
    name += f"({torch.get_num_threads()} threads)" if dev.type == "cpu" else ""
    return ComputeProfile(device=name.strip(), source="microbenchmark",
                          covariance=fit_kernel(cov), precondition=fit_kernel(pre),
                          eigh=fit_kernel(eig))
