"""GPU benchmarks of the CUDA kernels in kaisa._C against what a user would otherwise run.

Run on a machine with a CUDA device and a CUDA build of the extension::

    pytest bench/kernels/bench_kernels_gpu.py --benchmark-enable -p no:cacheprovider

Every comparison is against the real alternatives, at ResNet-50 sizes
(torchvision layout, 224x224 input, batch 32):

* ``conv_covariance``: the fused implicit-GEMM kernel vs ``F.unfold`` + matmul
  with TF32 off and on (cuBLAS; TF32 uses tensor cores), for every distinct conv
  shape, float32 and bfloat16 inputs; peak extra memory of each
  (``torch.cuda.max_memory_allocated``).
* ``covariance``: the kernel vs ``x.T @ x`` (TF32 off / on) for Linear-layer
  shapes.
* For both covariance ops, kaisa's own two paths forced one at a time
  (``KAISA_COVARIANCE_IMPL=fused|gemm``, GEMM with TF32 off and on) under
  ``'paths_ms'``: the data to fit the cost model's constants (``docs/cuda-kernels.md``).
* ``eigh``: ResNet-50's whole factor set (A and G of 53 convs + fc, sizes
  64...4608) per size bucket: ``batched_eigh`` vs one batched
  ``torch.linalg.eigh`` call per size vs ``cupy.linalg.eigh`` (when cupy is
  installed; recorded as unavailable otherwise).
* ``precondition``: ``eigen_precondition`` vs four ``torch.matmul`` and the
  division (:func:`kaisa.ops._reference.eigen_precondition`).

* ``inverse`` and ``eigen_refresh``: the cheaper decompositions of
  ``bench/experiments/decomposition_levers.py`` on ResNet-50's whole factor set
  (low-rank-plus-noise covariances, damping 1e-3 trace / n): the library's batched
  Cholesky inverse vs Newton-Schulz iterations in IEEE float32 warm-started from the
  previous inverse (the iterations its factors needed; how many diverge when the damping
  grows tenfold) and cold-started (one iteration's time times its iterations), and full
  eigh (one call, on the previous factors: the warm start's basis) vs the warm
  subspace-iteration refresh; with iterations and product errors against float64.

* ``syevj_knee``: ``batched_eigh`` of 64 matrices per size n = 8...128 with each routine
  forced (``KAISA_EIGH_IMPL``, ``KAISA_SYEVJ_MAX_N`` raised so syevj may take any n):
  the largest n where batched Jacobi still wins is the measured ``KAISA_SYEVJ_MAX_N``.

Every test times each variant with CUDA events (median after warm-up); the module
writes them, with ``speedup_vs_best`` = best alternative / kaisa, and each row's
**floor** (its fewest flops over the device's measured matmul rate for that precision,
or its fewest bytes over the measured copy bandwidth, whichever is larger; the
``ceilings`` are measured first) and ``gap`` = kaisa / floor, to
``bench/results/kernels_gpu_<device>.json`` (or ``$KAISA_BENCH_OUT``). Without a CUDA
device everything is skipped; with one, a missing extension or missing CUDA kernels
fail every benchmark (bench/kernels/conftest.py), so a broken build never looks green.

``KAISA_BENCH_DEVICE=cpu KAISA_BENCH_TINY=1`` runs the same code on the CPU kernels at
tiny sizes (the GPU script's dry run: plumbing and the JSON, not speed);
``KAISA_BENCH_DEADLINE`` (a Unix time) skips the benchmarks that would start after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kaisa.ops import _reference as ref

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
DEVICE = os.environ.get("KAISA_BENCH_DEVICE", "cuda")
TINY = os.environ.get("KAISA_BENCH_TINY", "0") not in ("", "0")
BATCH = 2 if TINY else 32
DEADLINE = float(os.environ.get("KAISA_BENCH_DEADLINE", "inf"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="no CUDA device"),
]


@pytest.fixture(autouse=True)
def _deadline() -> None:
    if time.time() > DEADLINE:
        pytest.skip("past KAISA_BENCH_DEADLINE")


# --------------------------------------------------------------------------- #
# ResNet-50 layer table
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Conv:
    """One convolution of ResNet-50: its input and geometry."""

    c_in: int
    c_out: int
    k: int
    stride: int
    pad: int
    h_in: int

    @property
    def a_dim(self) -> int:
        """Size of the A factor (no conv in ResNet-50 has a bias)."""
        return self.c_in * self.k * self.k

    @property
    def g_dim(self) -> int:
        """Size of the G factor."""
        return self.c_out

    @property
    def name(self) -> str:
        """Short id used in test ids and the results file."""
        return f"c{self.c_in}-o{self.c_out}-k{self.k}-s{self.stride}-h{self.h_in}"


def resnet50_convs() -> list[Conv]:
    """Every convolution of torchvision's ResNet-50 (v1.5: stride in the 3x3)."""
    convs = [Conv(3, 64, 7, 2, 3, 224)]
    h = 56  # after the stem conv (112) and the max pool
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        out = width * 4
        for b in range(blocks):
            s = stride if b == 0 else 1
            convs.append(Conv(c_in, width, 1, 1, 0, h))
            convs.append(Conv(width, width, 3, s, 1, h))
            h_out = (h + 2 - 3) // s + 1
            convs.append(Conv(width, out, 1, 1, 0, h_out))
            if b == 0:
                convs.append(Conv(c_in, out, 1, s, 0, h))
            c_in = out
            h = h_out
    return convs


FC_A_DIM = 2048 + 1  # fc layer input features plus its bias column
FC_G_DIM = 1000


def factor_dims() -> list[int]:
    """A and G factor sizes of all ResNet-50 layers (53 convs + fc = 108 factors)."""
    dims: list[int] = []
    for c in resnet50_convs():
        dims += [c.a_dim, c.g_dim]
    return [*dims, FC_A_DIM, FC_G_DIM]


def layer_shapes() -> list[tuple[int, int]]:
    """(G dim, A dim) = gradient shape (m, n) of every layer."""
    return [(c.g_dim, c.a_dim) for c in resnet50_convs()] + [(FC_G_DIM, FC_A_DIM)]


UNIQUE_CONVS: list[Conv] = sorted(set(resnet50_convs()), key=lambda c: c.name)
if TINY:  # the dry run: a few small geometries, scaled down
    UNIQUE_CONVS = [Conv(3, 8, 3, 2, 1, 12), Conv(8, 8, 1, 1, 0, 6), Conv(8, 16, 3, 1, 1, 6)]


# --------------------------------------------------------------------------- #
# timing, ceilings, floors and results
# --------------------------------------------------------------------------- #

_RESULTS: dict[str, Any] = {}
_CEILINGS: dict[str, float] = {}


def _device_tag() -> str:
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def synchronize() -> None:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 7) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    synchronize()
    times: list[float] = []
    for _ in range(iters):
        if DEVICE == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Peak memory allocated by one call of ``fn`` beyond what was allocated before it."""
    if DEVICE != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return int(torch.cuda.max_memory_allocated() - before)


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """Allows (or forbids) TF32 tensor-core matmuls inside the block."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def ceilings() -> dict[str, float]:
    """The device's measured ceilings (once): copy GB/s and matmul TFLOP/s per precision.

    Copy: a large device-to-device copy, bytes read plus written. Matmul: a square
    product of random inputs (``fp32`` IEEE, ``tf32``, ``bf16``, ``fp64``).
    """
    if _CEILINGS:
        return _CEILINGS
    n_copy, n_mm = (1 << 20, 256) if TINY else (1 << 28, 8192)
    x = torch.randn(n_copy // 4, device=DEVICE)
    y = torch.empty_like(x)
    _CEILINGS["copy_gbs"] = 2 * n_copy / (time_ms(lambda: y.copy_(x)) * 1e-3) / 1e9
    for name, dtype, allow in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                               ("bf16", torch.bfloat16, False), ("fp64", torch.float64, False)):
        n = n_mm // 2 if dtype == torch.float64 else n_mm
        a = torch.randn(n, n, device=DEVICE).to(dtype)
        b = torch.randn(n, n, device=DEVICE).to(dtype)
        with tf32(allow):
            ms = time_ms(lambda a=a, b=b: a @ b, warmup=2, iters=5)
        _CEILINGS[f"{name}_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    return _CEILINGS


def floor_ms(flops: float, nbytes: float, precision: str) -> float:
    """The row's floor: its flops at the measured rate, or its bytes at the copy bandwidth."""
    c = ceilings()
    return 1e3 * max(flops / (c[f"{precision}_tflops"] * 1e12), nbytes / (c["copy_gbs"] * 1e9))


def _precision(dtype: torch.dtype) -> str:
    return {torch.float64: "fp64", torch.bfloat16: "bf16", torch.float16: "bf16"}.get(dtype, "fp32")


def _compare(
    group: str, key: str, kaisa_fn: Callable[[], object],
    alternatives: dict[str, Callable[[], object]], memory: bool = False,
    paths: dict[str, Callable[[], object]] | None = None,
    floor: float | None = None, timing: tuple[int, int] = (2, 7), **extra: object,
) -> dict[str, Any]:
    """Times kaisa and every alternative, records them, the ratio to the best one and the
    gap to ``floor`` (milliseconds).

    ``paths`` are kaisa's own implementations forced one at a time (the covariance
    cost model's choices): timed and recorded under ``'paths_ms'`` with the one the
    model chose, never counted as alternatives.
    """
    times = {"kaisa": time_ms(kaisa_fn, *timing)}
    times.update({name: time_ms(fn, *timing) for name, fn in alternatives.items()})
    best_name = min(alternatives, key=lambda n: times[n])
    entry: dict[str, Any] = {
        "ms": {k: round(v, 4) for k, v in times.items()},
        "best_alternative": best_name,
        "speedup_vs_best": round(times[best_name] / times["kaisa"], 3),
        **extra,
    }
    if floor is not None:
        entry["floor_ms"] = round(floor, 5)
        entry["gap"] = round(times["kaisa"] / floor, 2)
    if paths:
        entry["paths_ms"] = {name: round(time_ms(fn, *timing), 4) for name, fn in paths.items()}
    if memory and DEVICE == "cuda":
        entry["peak_extra_bytes"] = {"kaisa": peak_extra_bytes(kaisa_fn)} | {
            name: peak_extra_bytes(fn) for name, fn in alternatives.items()
        }
    _RESULTS.setdefault(group, {})[key] = entry
    write_results()
    return entry


@pytest.fixture(scope="module", autouse=True)
def _write_results() -> Iterator[None]:
    yield
    write_results()


def write_results() -> None:
    """Writes what has been measured so far (after every row: a run cut short keeps it)."""
    if not _RESULTS:
        return
    path = os.environ.get("KAISA_BENCH_OUT") or os.path.join(
        RESULTS_DIR, f"kernels_gpu_{_device_tag()}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "batch": BATCH,
        "tiny": TINY,
        "ceilings": {k: round(v, 2) for k, v in _CEILINGS.items()},
        "results": _RESULTS,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------- #
# benchmarks
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """Sets the environment variable ``name`` inside the block (kaisa reads it per call)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def covariance_impl(name: str) -> contextlib.AbstractContextManager[None]:
    """Forces the covariance kernels' path (``KAISA_COVARIANCE_IMPL``, read per call)."""
    return env_var("KAISA_COVARIANCE_IMPL", name)


def covariance_paths(run: Callable[[], object]) -> dict[str, Callable[[], object]] | None:
    """``run`` under each covariance path: the fused kernel, cuBLAS GEMM in IEEE fp32
    and with TF32 allowed (bf16 inputs use tensor cores either way); None on the CPU."""
    if DEVICE != "cuda":
        return None

    def forced(name: str, allow_tf32: bool) -> Callable[[], object]:
        def call() -> object:
            with covariance_impl(name), tf32(allow_tf32):
                return run()

        return call

    return {"fused": forced("fused", False), "gemm_ieee": forced("gemm", False),
            "gemm_tf32": forced("gemm", True)}


def covariance_floor(rows: int, d: int, in_bytes: int, dtype: torch.dtype) -> float:
    """One triangle of ``X^T X`` (2 rows d(d+1)/2 flops); the input read, the output written."""
    size = torch.empty((), dtype=dtype).element_size()
    return floor_ms(rows * d * (d + 1), in_bytes + d * d * size, _precision(dtype))


def _unfold_matmul(x: torch.Tensor, conv: Conv, scale: float) -> torch.Tensor:
    """What a user would write: materialise the patches, one GEMM (fp32 accumulate)."""
    cols = F.unfold(x.float(), conv.k, padding=conv.pad, stride=conv.stride)  # (N, d, L)
    p = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return (p.T @ p).mul_(scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("conv", UNIQUE_CONVS, ids=[c.name for c in UNIQUE_CONVS])
def test_conv_covariance(benchmark: Any, conv: Conv, dtype: torch.dtype) -> None:
    x = torch.randn(BATCH, conv.c_in, conv.h_in, conv.h_in, device=DEVICE).to(dtype)
    ks, st, pd, dl = [conv.k, conv.k], [conv.stride] * 2, [conv.pad] * 2, [1, 1]
    h_out = (conv.h_in + 2 * conv.pad - conv.k) // conv.stride + 1
    scale = 1.0 / (BATCH * h_out * h_out)

    def kaisa() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.conv_covariance(x, ks, st, pd, dl, 1, False, scale)
        return out

    def unfold_fp32() -> torch.Tensor:
        with tf32(False):
            return _unfold_matmul(x, conv, scale)

    def unfold_tf32() -> torch.Tensor:
        with tf32(True):
            return _unfold_matmul(x, conv, scale)

    got = kaisa().double()
    want = ref.conv_covariance(x.double(), (conv.k,) * 2, (conv.stride,) * 2, (conv.pad,) * 2,
                               (1, 1), 1, False, scale)[0]
    rel = ((got[0] - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    rows = BATCH * h_out * h_out
    _compare(
        "conv_covariance", f"{conv.name}-{str(dtype)[6:]}", kaisa,
        {"unfold_matmul_fp32": unfold_fp32, "unfold_matmul_tf32": unfold_tf32},
        memory=True, paths=covariance_paths(kaisa), d=conv.a_dim, rows=rows,
        floor=covariance_floor(rows, conv.a_dim, x.numel() * x.element_size(), dtype),
    )
    benchmark(lambda: (kaisa(), synchronize()))


LINEAR_SHAPES = [(BATCH, 2049), (BATCH * 49, 2048), (8192, 1024), (65536, 512), (65536, 64)]
if TINY:
    LINEAR_SHAPES = [(BATCH, 33), (64, 16)]


@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=[f"{r}x{d}" for r, d in LINEAR_SHAPES])
def test_covariance(benchmark: Any, shape: tuple[int, int]) -> None:
    rows, d = shape
    x = torch.randn(rows, d, device=DEVICE)

    def kaisa() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.covariance(x, 1.0 / rows, False)
        return out

    def xtx(allow: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with tf32(allow):
                return (x.T @ x).mul_(1.0 / rows)

        return run

    _compare("covariance", f"{rows}x{d}", kaisa, {"xtx_fp32": xtx(False), "xtx_tf32": xtx(True)},
             paths=covariance_paths(kaisa), rows=rows, d=d,
             floor=covariance_floor(rows, d, x.numel() * 4, torch.float32))
    benchmark(lambda: (kaisa(), synchronize()))


def _spd(n: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(count, n, n, device=DEVICE, dtype=torch.float64) / n**0.5
    return (x @ x.mT + 1e-3 * torch.eye(n, device=DEVICE, dtype=torch.float64)).to(dtype)


def _cupy_eigh() -> Callable[[torch.Tensor], object] | None:
    if DEVICE != "cuda":
        return None
    try:
        import cupy
    except ImportError:
        return None

    def run(a: torch.Tensor) -> object:
        return cupy.linalg.eigh(cupy.from_dlpack(a))

    return run


EIGH_FLOPS_PER_N3 = 9.0
"""Flops of a symmetric eigendecomposition with vectors, per n^3 (Golub & Van Loan's
count for tridiagonalisation, the implicit QR steps and the back-transformation; an
order-of-magnitude floor, since the real routines' work depends on the spectrum)."""


def eigh_floor(n: int, count: int, dtype: torch.dtype) -> float:
    """The eigh floor of ``count`` matrices of size ``n``."""
    size = torch.empty((), dtype=dtype).element_size()
    return floor_ms(count * EIGH_FLOPS_PER_N3 * n**3, count * 2 * n * n * size, _precision(dtype))


def eigh_paths(a: torch.Tensor) -> dict[str, Callable[[], object]] | None:
    """kaisa's batched eigh with each routine for several matrices forced (the data for the
    routine choice by size and batch); None on the CPU."""
    if DEVICE != "cuda":
        return None

    def forced(impl: str) -> Callable[[], object]:
        def call() -> object:
            with env_var("KAISA_EIGH_IMPL", impl):
                return torch.ops.kaisa.batched_eigh(a)

        return call

    return {"xsyev_batched": forced("xsyev_batched"), "syevd": forced("syevd")}


def eigh_dims() -> list[int]:
    """The factor sizes decomposed: ResNet-50's, or a few small ones (tiny)."""
    return [4, 8, 8, 33] if TINY else factor_dims()


KNEE_SIZES = [4, 8] if TINY else [8, 16, 24, 32, 48, 64, 96, 128]
KNEE_BATCH = 4 if TINY else 64


def test_syevj_knee() -> None:
    """Each eigh routine forced on a batch per size: where batched Jacobi stops winning."""
    rows: dict[str, Any] = {}
    knee = 0
    for n in KNEE_SIZES:
        a = _spd(n, KNEE_BATCH, torch.float32)
        ms: dict[str, float | str] = {}
        for impl in ("syevj", "xsyev_batched", "syevd"):
            with env_var("KAISA_EIGH_IMPL", impl), env_var("KAISA_SYEVJ_MAX_N", "100000"):
                try:
                    ms[impl] = round(time_ms(lambda a=a: torch.ops.kaisa.batched_eigh(a), 1, 5), 4)
                except RuntimeError as err:  # a routine the library refuses at this n
                    ms[impl] = f"error: {str(err).splitlines()[0][:160]}"
        timed = {k: v for k, v in ms.items() if isinstance(v, float)}
        winner = min(timed, key=lambda k: timed[k]) if timed else None
        if winner == "syevj":
            knee = n
        rows[f"n{n}-b{KNEE_BATCH}"] = {"ms": ms, "fastest": winner}
    _RESULTS["syevj_knee"] = {"sizes": rows, "measured_knee_n": knee, "default_n": 32}
    write_results()


PRECOND_SHAPES: list[tuple[int, int, int]] = sorted(
    {(m, n, layer_shapes().count((m, n))) for m, n in layer_shapes()}
)
if TINY:
    PRECOND_SHAPES = [(8, 5, 2), (16, 9, 1)]


@pytest.mark.parametrize("use_dgda", [False, True], ids=["da_dg", "dgda"])
@pytest.mark.parametrize(
    "shape", PRECOND_SHAPES, ids=[f"m{m}-n{n}-b{b}" for m, n, b in PRECOND_SHAPES]
)
def test_precondition(benchmark: Any, shape: tuple[int, int, int], use_dgda: bool) -> None:
    m, n, b = shape
    grad = torch.randn(b, m, n, device=DEVICE)
    qa = torch.linalg.qr(torch.randn(b, n, n, device=DEVICE))[0]
    qg = torch.linalg.qr(torch.randn(b, m, m, device=DEVICE))[0]
    da = torch.rand(b, n, device=DEVICE)
    dg = torch.rand(b, m, device=DEVICE)
    damping = 1e-3
    dgda = 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + damping) if use_dgda else None
    pa, pg = (None, None) if use_dgda else (da, dg)

    def kaisa() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.eigen_precondition(grad, qa, qg, pa, pg, dgda, damping)
        return out

    def four_matmuls() -> torch.Tensor:
        with tf32(False):
            return ref.eigen_precondition(grad, qa, qg, pa, pg, dgda, damping)

    got, want = kaisa(), four_matmuls()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    key = f"m{m}-n{n}-b{b}-{'dgda' if use_dgda else 'da_dg'}"
    nbytes = 4 * b * (2 * m * n + m * m + n * n + (m * n if use_dgda else m + n))
    _compare("precondition", key, kaisa, {"four_matmuls_fp32": four_matmuls},
             floor=floor_ms(4 * b * m * n * (m + n), nbytes, "fp32"))
    benchmark(lambda: (kaisa(), synchronize()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_eigh_resnet50_factor_set(benchmark: Any, dtype: torch.dtype) -> None:
    counts: dict[int, int] = {}
    for d in eigh_dims():
        counts[d] = counts.get(d, 0) + 1
    batches = {n: _spd(n, c, dtype) for n, c in sorted(counts.items())}
    cupy_eigh = _cupy_eigh()
    totals = {"kaisa": 0.0, "torch_batched": 0.0, "cupy": 0.0, "floor": 0.0}
    for n, a in batches.items():
        alternatives: dict[str, Callable[[], object]] = {
            "torch_batched": lambda a=a: torch.linalg.eigh(a)
        }
        if cupy_eigh is not None:
            alternatives["cupy"] = lambda a=a: cupy_eigh(a)
        floor = eigh_floor(n, a.shape[0], dtype)
        entry = _compare(
            "eigh", f"n{n}-b{a.shape[0]}-{str(dtype)[6:]}",
            lambda a=a: torch.ops.kaisa.batched_eigh(a), alternatives, floor=floor,
            timing=(1, 3), impl=os.environ.get("KAISA_EIGH_IMPL", "auto"),
            paths=eigh_paths(a) if dtype == torch.float32 and a.shape[0] > 1 else None,
        )
        for name, ms in entry["ms"].items():
            totals[name] += ms
        totals["floor"] += floor
    best = min(v for k, v in totals.items() if k not in ("kaisa", "floor") and v > 0)
    _RESULTS["eigh"][f"whole-set-{str(dtype)[6:]}"] = {
        "ms": {k: round(v, 3) for k, v in totals.items() if v > 0 and k != "floor"},
        "best_alternative": min((k for k in totals if k not in ("kaisa", "floor")
                                 and totals[k] > 0), key=lambda k: totals[k]),
        "speedup_vs_best": round(best / totals["kaisa"], 3),
        "floor_ms": round(totals["floor"], 5),
        "gap": round(totals["kaisa"] / totals["floor"], 2),
        "factors": sum(counts.values()),
        "cupy": "measured" if cupy_eigh is not None else "unavailable",
    }

    def whole_set() -> None:
        for a in batches.values():
            torch.ops.kaisa.batched_eigh(a)

    benchmark.pedantic(lambda: (whole_set(), synchronize()), rounds=1, iterations=1)


def _levers() -> Any:
    """``bench/experiments/decomposition_levers.py``: the measurements the CPU script makes."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "experiments")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import decomposition_levers

    return decomposition_levers


def _row(group: str, key: str, ms: dict[str, float], floor: float, **extra: object) -> None:
    """A row timed by the caller: ``ms`` holds ``kaisa`` (the library's way) and the rest."""
    best = min((k for k in ms if k != "kaisa"), key=lambda k: ms[k])
    _RESULTS.setdefault(group, {})[key] = {
        "ms": {k: round(v, 4) for k, v in ms.items()},
        "best_alternative": best,
        "speedup_vs_best": round(ms[best] / ms["kaisa"], 3),
        "floor_ms": round(floor, 5),
        "gap": round(ms["kaisa"] / floor, 2),
        **extra,
    }
    write_results()


def _timed_once(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and its milliseconds (CUDA events on a GPU)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return out, 1e3 * (time.perf_counter() - t0)
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end)


#: Newton-Schulz's flops per iteration, per n^3 (two GEMMs), and Cholesky inverse's
#: (potrf n^3 / 3 and potri 2 n^3 / 3).
NEWTON_SCHULZ_FLOPS_PER_N3 = 4.0
CHOLESKY_INVERSE_FLOPS_PER_N3 = 1.0


def test_decomposition_levers_resnet50_factor_set() -> None:
    """Newton-Schulz inverses vs Cholesky, the warm eigenbasis refresh vs eigh, per size and
    for the whole set (ResNet-50's factors, or the tiny sizes)."""
    from kaisa.methods.linalg import (
        damped_inverses,
        eigen_decompositions,
        warm_eigen_decompositions,
    )

    dl = _levers()
    fp32 = torch.float32
    scenarios = (dl.SCENARIOS[0], next(s for s in dl.SCENARIOS if s[2] == 10.0))
    totals: dict[str, dict[str, float]] = {"inverse": {}, "eigen_refresh": {}}
    floors = {"inverse": 0.0, "eigen_refresh": 0.0}
    extras: dict[str, dict[str, Any]] = {"inverse": {}, "eigen_refresh": {}}
    with tf32(False):
        for n, count in sorted(Counter(eigh_dims()).items()):
            g = dl.measure_group(n, count, "low_rank", torch.device(DEVICE), 0,
                                 scenarios=scenarios, colds=("identity",), exact=False,
                                 eigen=False, max_iter=40)
            s = g.summary
            m = dl.damped(g.f, g.lam, fp32)
            cold = s["cold_identity"]["iterations_used"]["max"]

            def cholesky(g: Any = g) -> object:
                return damped_inverses([g.f], damping=[g.lam], inv_dtype=fp32)

            def newton_schulz(iterations: int, m: torch.Tensor = m, g: Any = g) -> object:
                return dl.newton_schulz_fixed(m, g.x_prev, iterations)

            def refresh(g: Any = g) -> object:
                return warm_eigen_decompositions([g.f], [g.q_prev], inv_dtype=fp32)

            one = time_ms(partial(newton_schulz, 1), 1, 3)
            ms = {
                "kaisa": time_ms(cholesky, 1, 3),
                "newton_schulz_warm": time_ms(partial(newton_schulz, g.warm_iterations), 0, 2),
                "newton_schulz_cold_projected": one * cold,
            }
            floor = floor_ms(CHOLESKY_INVERSE_FLOPS_PER_N3 * count * n**3,
                             count * 2 * n * n * 4, "fp32")
            rule = s["warm"][scenarios[0][0]]
            extra = {
                "warm_iterations": g.warm_iterations, "cold_iterations": cold,
                "newton_schulz_iteration_ms": round(one, 4),
                "warm_reached_target": f"{rule['iterations_to_target']['reached']}/{count}",
                "warm_reached_1e-6": f"{rule['iterations_to_1e-6']['reached']}/{count}",
                "warm_diverged_damping_x10": s["warm"][scenarios[1][0]]["diverged"],
                "product_error_max": {"cholesky": s["cholesky"]["product_error"]["max"],
                                      "newton_schulz_warm": rule["product_error"]["max"],
                                      "newton_schulz_cold":
                                          s["cold_identity"]["product_error"]["max"]},
            }
            _row("inverse", f"n{n}-b{count}-float32", ms, floor, **extra)
            prev, eigh_ms = _timed_once(partial(eigen_decompositions, [g.f_prev],
                                                inv_dtype=fp32))
            g.q_prev = prev[0].eigenvectors
            warm = warm_eigen_decompositions([g.f], [g.q_prev], inv_dtype=fp32)[0]
            full = eigen_decompositions([g.f], inv_dtype=fp32)[0] if TINY else None
            refresh_ms = time_ms(refresh, 0, 2)
            eig_floor = eigh_floor(n, count, fp32)
            eig_extra = {"product_error_max": {
                "warm_refresh": dl.eigen_product_error(g, warm)["max"],
                **({"eigh": dl.eigen_product_error(g, full)["max"]} if full else {})}}
            _row("eigen_refresh", f"n{n}-b{count}-float32",
                 {"kaisa": eigh_ms, "warm_refresh": refresh_ms}, eig_floor, **eig_extra)
            for group, times, fl, ex in (("inverse", ms, floor, extra),
                                         ("eigen_refresh", {"kaisa": eigh_ms,
                                                            "warm_refresh": refresh_ms},
                                          eig_floor, eig_extra)):
                for k, v in times.items():
                    totals[group][k] = totals[group].get(k, 0.0) + v
                floors[group] += fl
                extras[group][str(n)] = ex
    for group in totals:
        _row(group, "whole-set-float32", totals[group], floors[group],
             factors=sum(Counter(eigh_dims()).values()),
             data="low_rank covariances, damping 1e-3 trace / n (decomposition_levers.py)",
             **({"sizes": {n: {k: v for k, v in e.items() if k in (
                 "warm_iterations", "cold_iterations", "warm_diverged_damping_x10")}
                 for n, e in extras[group].items()}} if group == "inverse" else {}))


def test_layer_table_matches_resnet50() -> None:
    """53 convolutions + fc; factor sizes as listed in docs/cuda-kernels.md."""
    convs = resnet50_convs()
    assert len(convs) == 53
    assert max(c.a_dim for c in convs) == 4608
    assert sorted({c.a_dim for c in convs}) == [
        64,
        128,
        147,
        256,
        512,
        576,
        1024,
        1152,
        2048,
        2304,
        4608,
    ]
    assert sorted({c.g_dim for c in convs}) == [64, 128, 256, 512, 1024, 2048]
