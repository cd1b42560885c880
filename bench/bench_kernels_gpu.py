"""GPU benchmarks of the CUDA kernels in kaisa._C against what a user would otherwise run.

Run on a machine with a CUDA device and a CUDA build of the extension::

    pytest bench/bench_kernels_gpu.py --benchmark-enable -p no:cacheprovider

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

Every test times each variant with CUDA events (median after warm-up); the module
writes them, with ``speedup_vs_best`` = best alternative / kaisa, to
``bench/results/kernels_gpu_<device>.json``. Without a CUDA device everything
is skipped; with one, a missing extension or missing CUDA kernels fail every
benchmark (bench/conftest.py), so a broken build never looks green.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kaisa.ops import _reference as ref

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BATCH = 32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


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


# --------------------------------------------------------------------------- #
# timing and results
# --------------------------------------------------------------------------- #

_RESULTS: dict[str, Any] = {}


def _device_tag() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def cuda_time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 7) -> float:
    """Median wall time of ``fn`` on the current stream, in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak memory allocated by one call of ``fn`` beyond what was allocated before it."""
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


def _compare(
    group: str, key: str, kaisa_fn: Callable[[], object],
    alternatives: dict[str, Callable[[], object]], memory: bool = False,
    paths: dict[str, Callable[[], object]] | None = None, **extra: object,
) -> dict[str, Any]:
    """Times kaisa and every alternative, records them and the ratio to the best one.

    ``paths`` are kaisa's own implementations forced one at a time (the covariance
    cost model's choices): timed and recorded under ``'paths_ms'`` with the one the
    model chose, never counted as alternatives.
    """
    times = {"kaisa": cuda_time_ms(kaisa_fn)}
    times.update({name: cuda_time_ms(fn) for name, fn in alternatives.items()})
    best_name = min(alternatives, key=lambda n: times[n])
    entry: dict[str, Any] = {
        "ms": {k: round(v, 4) for k, v in times.items()},
        "best_alternative": best_name,
        "speedup_vs_best": round(times[best_name] / times["kaisa"], 3),
        **extra,
    }
    if paths:
        entry["paths_ms"] = {name: round(cuda_time_ms(fn), 4) for name, fn in paths.items()}
    if memory:
        entry["peak_extra_bytes"] = {"kaisa": peak_extra_bytes(kaisa_fn)} | {
            name: peak_extra_bytes(fn) for name, fn in alternatives.items()
        }
    _RESULTS.setdefault(group, {})[key] = entry
    return entry


@pytest.fixture(scope="module", autouse=True)
def _write_results() -> Iterator[None]:
    yield
    if not _RESULTS:
        return
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"kernels_gpu_{_device_tag()}.json")
    payload = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "batch": BATCH,
        "results": _RESULTS,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------- #
# benchmarks
# --------------------------------------------------------------------------- #


@contextlib.contextmanager
def covariance_impl(name: str) -> Iterator[None]:
    """Forces the covariance kernels' path (``KAISA_COVARIANCE_IMPL``, read per call)."""
    before = os.environ.get("KAISA_COVARIANCE_IMPL")
    os.environ["KAISA_COVARIANCE_IMPL"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["KAISA_COVARIANCE_IMPL"]
        else:
            os.environ["KAISA_COVARIANCE_IMPL"] = before


def covariance_paths(run: Callable[[], object]) -> dict[str, Callable[[], object]]:
    """``run`` under each covariance path: the fused kernel, cuBLAS GEMM in IEEE fp32
    and with TF32 allowed (bf16 inputs use tensor cores either way)."""

    def forced(name: str, allow_tf32: bool) -> Callable[[], object]:
        def call() -> object:
            with covariance_impl(name), tf32(allow_tf32):
                return run()

        return call

    return {"fused": forced("fused", False), "gemm_ieee": forced("gemm", False),
            "gemm_tf32": forced("gemm", True)}


def _unfold_matmul(x: torch.Tensor, conv: Conv, scale: float) -> torch.Tensor:
    """What a user would write: materialise the patches, one GEMM (fp32 accumulate)."""
    cols = F.unfold(x.float(), conv.k, padding=conv.pad, stride=conv.stride)  # (N, d, L)
    p = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return (p.T @ p).mul_(scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("conv", UNIQUE_CONVS, ids=[c.name for c in UNIQUE_CONVS])
def test_conv_covariance(benchmark: Any, conv: Conv, dtype: torch.dtype) -> None:
    x = torch.randn(BATCH, conv.c_in, conv.h_in, conv.h_in, device="cuda").to(dtype)
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
    _compare(
        "conv_covariance", f"{conv.name}-{str(dtype)[6:]}", kaisa,
        {"unfold_matmul_fp32": unfold_fp32, "unfold_matmul_tf32": unfold_tf32},
        memory=True, paths=covariance_paths(kaisa), d=conv.a_dim, rows=BATCH * h_out * h_out,
    )
    benchmark(lambda: (kaisa(), torch.cuda.synchronize()))


LINEAR_SHAPES = [(BATCH, 2049), (BATCH * 49, 2048), (8192, 1024), (65536, 512), (65536, 64)]


@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=[f"{r}x{d}" for r, d in LINEAR_SHAPES])
def test_covariance(benchmark: Any, shape: tuple[int, int]) -> None:
    rows, d = shape
    x = torch.randn(rows, d, device="cuda")

    def kaisa() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.covariance(x, 1.0 / rows, False)
        return out

    def xtx(allow: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with tf32(allow):
                return (x.T @ x).mul_(1.0 / rows)

        return run

    _compare("covariance", f"{rows}x{d}", kaisa, {"xtx_fp32": xtx(False), "xtx_tf32": xtx(True)},
             paths=covariance_paths(kaisa))
    benchmark(lambda: (kaisa(), torch.cuda.synchronize()))


def _spd(n: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(count, n, n, device="cuda", dtype=torch.float64) / n**0.5
    return (x @ x.mT + 1e-3 * torch.eye(n, device="cuda", dtype=torch.float64)).to(dtype)


def _cupy_eigh() -> Callable[[torch.Tensor], object] | None:
    try:
        import cupy
    except ImportError:
        return None

    def run(a: torch.Tensor) -> object:
        return cupy.linalg.eigh(cupy.from_dlpack(a))

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_eigh_resnet50_factor_set(benchmark: Any, dtype: torch.dtype) -> None:
    counts: dict[int, int] = {}
    for d in factor_dims():
        counts[d] = counts.get(d, 0) + 1
    batches = {n: _spd(n, c, dtype) for n, c in sorted(counts.items())}
    cupy_eigh = _cupy_eigh()
    totals = {"kaisa": 0.0, "torch_batched": 0.0, "cupy": 0.0}
    for n, a in batches.items():
        alternatives: dict[str, Callable[[], object]] = {
            "torch_batched": lambda a=a: torch.linalg.eigh(a)
        }
        if cupy_eigh is not None:
            alternatives["cupy"] = lambda a=a: cupy_eigh(a)
        entry = _compare(
            "eigh", f"n{n}-b{a.shape[0]}-{str(dtype)[6:]}",
            lambda a=a: torch.ops.kaisa.batched_eigh(a), alternatives,
            impl=os.environ.get("KAISA_EIGH_IMPL", "auto"),
        )
        for name, ms in entry["ms"].items():
            totals[name] += ms
    best = min(v for k, v in totals.items() if k != "kaisa" and v > 0)
    _RESULTS["eigh"][f"whole-set-{str(dtype)[6:]}"] = {
        "ms": {k: round(v, 3) for k, v in totals.items() if v > 0},
        "speedup_vs_best": round(best / totals["kaisa"], 3),
        "factors": sum(counts.values()),
        "cupy": "measured" if cupy_eigh is not None else "unavailable (cupy not installed)",
    }

    def whole_set() -> None:
        for a in batches.values():
            torch.ops.kaisa.batched_eigh(a)

    benchmark.pedantic(lambda: (whole_set(), torch.cuda.synchronize()), rounds=2, iterations=1)


PRECOND_SHAPES: list[tuple[int, int, int]] = sorted(
    {(m, n, layer_shapes().count((m, n))) for m, n in layer_shapes()}
)


@pytest.mark.parametrize("use_dgda", [False, True], ids=["da_dg", "dgda"])
@pytest.mark.parametrize(
    "shape", PRECOND_SHAPES, ids=[f"m{m}-n{n}-b{b}" for m, n, b in PRECOND_SHAPES]
)
def test_precondition(benchmark: Any, shape: tuple[int, int, int], use_dgda: bool) -> None:
    m, n, b = shape
    grad = torch.randn(b, m, n, device="cuda")
    qa = torch.linalg.qr(torch.randn(b, n, n, device="cuda"))[0]
    qg = torch.linalg.qr(torch.randn(b, m, m, device="cuda"))[0]
    da = torch.rand(b, n, device="cuda")
    dg = torch.rand(b, m, device="cuda")
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
    _compare("precondition", key, kaisa, {"four_matmuls_fp32": four_matmuls})
    benchmark(lambda: (kaisa(), torch.cuda.synchronize()))


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
