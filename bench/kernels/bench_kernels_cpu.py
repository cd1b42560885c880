"""CPU micro-benchmarks of the kaisa.ops kernels: extension vs reference.

Run (takes a few minutes on 2 cores)::

    pytest bench/kernels/bench_kernels_cpu.py --benchmark-enable \
        --benchmark-json bench/results/kernels_cpu.json

Each benchmark group holds an ``ext`` (kaisa._C) and a ``reference`` (pure
PyTorch: ``F.unfold`` + matmul for the conv factor) variant; bench/kernels/conftest.py
adds the median ratios to the JSON under ``kaisa_summary``. The peak extra
memory of conv_covariance is measured in a fresh subprocess per variant (VmHWM
after resetting it via /proc/self/clear_refs, minus the RSS before the call)
and written to bench/results/conv_covariance_memory.json.

``KAISA_BENCH_THREADS=N`` sets ``torch.set_num_threads(N)`` first; on a small
or busy machine a single-thread run (``bench/results/kernels_cpu_1thread.json``)
separates the algorithmic gain from thread-synchronisation noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref

pytestmark = pytest.mark.skipif(
    not ops.extension_available(), reason=f"kaisa._C not available: {ops.extension_error()}"
)

if os.environ.get("KAISA_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["KAISA_BENCH_THREADS"]))

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the root: bench.harness
from bench import harness  # noqa: E402

RESULTS = harness.RESULTS
IMPLS = ["ext", "reference"]

# name: (input shape, kernel, stride, padding)
CONV_CASES: dict[str, tuple[tuple[int, int, int, int], int, int, int]] = {
    "32x64x32x32_k3": ((32, 64, 32, 32), 3, 1, 1),
    "r50_8x64x56x56_k1": ((8, 64, 56, 56), 1, 1, 0),
    "r50_8x64x56x56_k3": ((8, 64, 56, 56), 3, 1, 1),
    "r50_8x256x56x56_k1": ((8, 256, 56, 56), 1, 1, 0),
    "r50_8x128x28x28_k3": ((8, 128, 28, 28), 3, 1, 1),
    "r50_8x512x7x7_k3": ((8, 512, 7, 7), 3, 1, 1),
    "r50_8x3x224x224_k7s2": ((8, 3, 224, 224), 7, 2, 3),
}

# name: (grad (m, n), batch)
EIGEN_CASES: dict[str, tuple[int, int, int]] = {
    "64x576": (64, 576, 1),
    "576x576": (576, 576, 1),
    "512x2304": (512, 2304, 1),
    "batch8_128x128": (128, 128, 8),
}

COV_CASES: dict[str, tuple[int, int]] = {
    "linear_8192x1024": (8192, 1024),
    "linear_32768x577": (32768, 577),
}


def _rounds(seconds_per_call: float) -> int:
    return 3 if seconds_per_call > 0.3 else 5


def _run(benchmark: Any, fn: Callable[[], object], rounds: int = 5) -> None:
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


def _set_group(benchmark: Any, group: str, impl: str, **info: object) -> None:
    benchmark.group = group
    benchmark.extra_info.update({"impl": impl, "threads": torch.get_num_threads(), **info})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_covariance(benchmark: Any, case: str, impl: str) -> None:
    shape, k, s, p = CONV_CASES[case]
    x = torch.randn(*shape)
    args = ((k, k), (s, s), (p, p), (1, 1), 1, True, 1.0 / shape[0])
    _set_group(benchmark, f"conv_covariance/{case}", impl, shape=list(shape), k=k, s=s, p=p)
    if impl == "ext":
        with ops.use_backend("ext"):
            _run(benchmark, lambda: ops.conv_covariance(x, *args), rounds=5)
    else:
        _run(benchmark, lambda: ref.conv_covariance(x, *args), rounds=3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(COV_CASES))
def test_covariance(benchmark: Any, case: str, impl: str) -> None:
    rows, d = COV_CASES[case]
    x = torch.randn(rows, d)
    _set_group(benchmark, f"covariance/{case}", impl)
    if impl == "ext":
        with ops.use_backend("ext"):
            _run(benchmark, lambda: ops.covariance(x, 1.0 / rows, bias=True))
    else:
        _run(benchmark, lambda: ref.covariance(x, 1.0 / rows, bias=True))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["dadg", "dgda"])
@pytest.mark.parametrize("case", list(EIGEN_CASES))
def test_eigen_precondition(benchmark: Any, case: str, mode: str, impl: str) -> None:
    m, n, b = EIGEN_CASES[case]
    grad = torch.randn(b, m, n)
    qa = torch.linalg.qr(torch.randn(b, n, n))[0]
    qg = torch.linalg.qr(torch.randn(b, m, m))[0]
    da = torch.rand(b, n)
    dg = torch.rand(b, m)
    dgda = 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + 0.01) if mode == "dgda" else None
    _set_group(benchmark, f"eigen_precondition/{mode}/{case}", impl)
    if impl == "ext":
        with ops.use_backend("ext"):
            if dgda is None:
                _run(
                    benchmark,
                    lambda: ops.eigen_precondition(grad, qa, qg, da=da, dg=dg, damping=0.01),
                )
            else:
                _run(benchmark, lambda: ops.eigen_precondition(grad, qa, qg, dgda=dgda))
    else:
        _run(benchmark, lambda: ref.eigen_precondition(grad, qa, qg, da, dg, dgda, 0.01))


# name: (matrices of one size, size); ResNet-32's factor groups (A: 3x3 convs of
# 16/32/64 channels, G: their outputs) and two larger sizes.
EIGH_CASES: dict[str, tuple[int, int]] = {
    "r32_G_10x16": (10, 16),
    "r32_G_10x64": (10, 64),
    "r32_A_10x144": (10, 144),
    "r32_A_10x288": (10, 288),
    "r32_A_10x576": (10, 576),
    "4x1152": (4, 1152),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(EIGH_CASES))
def test_eigh(benchmark: Any, case: str, impl: str) -> None:
    """kaisa's matrix-parallel batched_eigh vs one batched torch.linalg.eigh call."""
    count, n = EIGH_CASES[case]
    x = torch.randn(count, n, n + 8)
    a = x @ x.transpose(1, 2) / n
    _set_group(benchmark, f"eigh/{case}", impl)
    if impl == "ext":
        with ops.use_backend("ext"):
            _run(benchmark, lambda: ops.eigh(a), rounds=5)
    else:
        _run(benchmark, lambda: torch.linalg.eigh(a), rounds=5)


_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import kaisa.ops as ops
    from kaisa.ops import _reference as ref

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return -1

    impl, shape, k, s, p = sys.argv[1], eval(sys.argv[2]), *map(int, sys.argv[3:6])
    torch.manual_seed(0)
    x = torch.randn(*shape)
    args = ((k, k), (s, s), (p, p), (1, 1), 1, True, 1.0)
    fn = (lambda: ops.conv_covariance(x, *args)) if impl == "ext" else (
        lambda: ref.conv_covariance(x, *args))
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    before = status("VmRSS")
    hwm0 = status("VmHWM")
    out = fn()
    peak = status("VmHWM")
    print(json.dumps({"rss_before": before, "hwm_reset": hwm0, "hwm_after": peak,
                      "extra": peak - before, "output_bytes": out.numel() * out.element_size(),
                      "input_bytes": x.numel() * x.element_size()}))
    """
)


def _measure_memory(impl: str, case: str) -> dict[str, Any]:
    shape, k, s, p = CONV_CASES[case]
    env = dict(os.environ)
    env["KAISA_BACKEND"] = "ext"
    res = subprocess.run(
        [sys.executable, "-c", _MEMORY_SCRIPT, impl, str(list(shape)), str(k), str(s), str(p)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


def test_conv_covariance_peak_memory(benchmark: Any) -> None:
    summary: dict[str, Any] = {}
    for case in ["32x64x32x32_k3", "r50_8x64x56x56_k3", "r50_8x3x224x224_k7s2"]:
        ext = _measure_memory("ext", case)
        reference = _measure_memory("reference", case)
        summary[case] = {
            "ext": ext,
            "reference": reference,
            "extra_ratio_ext_over_reference": ext["extra"] / max(reference["extra"], 1),
        }
    doc = {
        "description": "peak extra RSS (bytes) of one conv_covariance call, fresh process per "
        "variant; extra = VmHWM after the call (reset before it) - VmRSS before it",
        "threads": torch.get_num_threads(),
        "cases": summary,
    }
    harness.write(RESULTS / "conv_covariance_memory.json", "conv_covariance_memory", doc,
                  ["--benchmark-enable"], script="-m pytest bench/kernels/bench_kernels_cpu.py",
                  indent=2)
    benchmark.group = "memory/conv_covariance"
    benchmark.extra_info.update(summary)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    main = summary["32x64x32x32_k3"]["extra_ratio_ext_over_reference"]
    assert main <= 0.25, f"ext peak extra memory ratio {main:.3f} > 1/4"
