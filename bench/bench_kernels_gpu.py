"""GPU benchmarks of the CUDA kernels in kaisa._C against the reference ops.

Run on a machine with a CUDA device and a CUDA build of the extension::

    pytest bench/bench_kernels_gpu.py --benchmark-enable -p no:cacheprovider

Three groups, all at ResNet-50 sizes (torchvision layout, 224x224 input):

* ``conv_covariance``: the fused implicit-GEMM kernel vs ``F.unfold`` + matmul
  (:func:`kaisa.ops._reference.conv_covariance`) for every distinct conv layer
  shape at batch 32, float32 and bfloat16 inputs;
* ``eigh``: the eigendecomposition of ResNet-50's whole factor set (the A and G
  factor of every conv / fc layer), ``batched_eigh`` called once per distinct
  size vs a Python loop of :func:`torch.linalg.eigh`;
* ``precondition``: ``eigen_precondition`` vs the reference for every distinct
  (G dim, A dim) layer shape, batched over the layers sharing it.

Besides pytest-benchmark's own report, every test times both sides with CUDA
events (median of several runs, after warm-up) and the module writes them to
``bench/results/kernels_gpu_<device>.json``. Without CUDA (or without the CUDA
kernels) everything is skipped.
"""

from __future__ import annotations

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

import kaisa.ops as ops
from kaisa.ops import _reference as ref

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BATCH = 32


def _missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not ops.extension_available():
        return f"kaisa._C not available: {ops.extension_error()}"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("kaisa::conv_covariance", "CUDA"):
        return "kaisa._C was built without CUDA kernels"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


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


def cuda_time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 5) -> float:
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


def _record(group: str, key: str, ext_ms: float, ref_ms: float, **extra: object) -> None:
    _RESULTS.setdefault(group, {})[key] = {
        "ext_ms": round(ext_ms, 4),
        "reference_ms": round(ref_ms, 4),
        "speedup": round(ref_ms / ext_ms, 3) if ext_ms > 0 else None,
        **extra,
    }


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("conv", UNIQUE_CONVS, ids=[c.name for c in UNIQUE_CONVS])
def test_conv_covariance(benchmark: Any, conv: Conv, dtype: torch.dtype) -> None:
    x = torch.randn(BATCH, conv.c_in, conv.h_in, conv.h_in, device="cuda").to(dtype)
    ks, st, pd, dl = [conv.k, conv.k], [conv.stride] * 2, [conv.pad] * 2, [1, 1]
    h_out = (conv.h_in + 2 * conv.pad - conv.k) // conv.stride + 1
    scale = 1.0 / (BATCH * h_out * h_out)

    def ext() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.conv_covariance(x, ks, st, pd, dl, 1, False, scale)
        return out

    def reference() -> torch.Tensor:
        return ref.conv_covariance(
            x, (conv.k,) * 2, (conv.stride,) * 2, (conv.pad,) * 2, (1, 1), 1, False, scale
        )

    got, want = ext().float(), reference().float()
    rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert rel < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    ext_ms, ref_ms = cuda_time_ms(ext), cuda_time_ms(reference)
    _record(
        "conv_covariance",
        f"{conv.name}-{str(dtype)[6:]}",
        ext_ms,
        ref_ms,
        d=conv.a_dim,
        rows=BATCH * h_out * h_out,
    )
    benchmark(lambda: (ext(), torch.cuda.synchronize()))


def _spd(n: int, count: int) -> torch.Tensor:
    x = torch.randn(count, n, n, device="cuda") / n**0.5
    return x @ x.mT + 1e-3 * torch.eye(n, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_eigh_resnet50_factor_set(benchmark: Any, dtype: torch.dtype) -> None:
    dims = factor_dims()
    groups: dict[int, int] = {}
    for d in dims:
        groups[d] = groups.get(d, 0) + 1
    batches = {n: _spd(n, count).to(dtype) for n, count in sorted(groups.items())}

    def ext() -> None:
        for a in batches.values():
            torch.ops.kaisa.batched_eigh(a)

    def reference() -> None:
        for a in batches.values():
            for m in a:
                torch.linalg.eigh(m)

    ext_ms = cuda_time_ms(ext, warmup=1, iters=3)
    ref_ms = cuda_time_ms(reference, warmup=1, iters=3)
    per_size: dict[str, Any] = {}
    for n, a in batches.items():
        e = cuda_time_ms(lambda a=a: torch.ops.kaisa.batched_eigh(a), warmup=1, iters=3)
        r = cuda_time_ms(lambda a=a: [torch.linalg.eigh(m) for m in a], warmup=1, iters=3)
        per_size[str(n)] = {"count": a.shape[0], "ext_ms": round(e, 4), "reference_ms": round(r, 4)}
    _record(
        "eigh",
        f"resnet50-{str(dtype)[6:]}",
        ext_ms,
        ref_ms,
        factors=len(dims),
        distinct_sizes=len(batches),
        per_size=per_size,
        impl=os.environ.get("KAISA_EIGH_IMPL", "auto"),
    )
    benchmark.pedantic(lambda: (ext(), torch.cuda.synchronize()), rounds=2, iterations=1)


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

    def ext() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.eigen_precondition(grad, qa, qg, pa, pg, dgda, damping)
        return out

    def reference() -> torch.Tensor:
        return ref.eigen_precondition(grad, qa, qg, pa, pg, dgda, damping)

    got, want = ext(), reference()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-3
    ext_ms, ref_ms = cuda_time_ms(ext), cuda_time_ms(reference)
    key = f"m{m}-n{n}-b{b}-{'dgda' if use_dgda else 'da_dg'}"
    _record("precondition", key, ext_ms, ref_ms)
    benchmark(lambda: (ext(), torch.cuda.synchronize()))


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
