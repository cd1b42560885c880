"""The gpu tests and GPU benchmarks fail (never skip) on a GPU machine with a broken build."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import kaisa.ops as ops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Pretends a CUDA device is present, then runs one gpu test and one GPU benchmark.
_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.cuda.is_available = lambda: True
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
    """
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, "-q", "-p", "no:cacheprovider", "-rfEs", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )


@pytest.mark.slow
@pytest.mark.skipif(ops.cuda_kernels_error() is None, reason="this build has its CUDA kernels")
@pytest.mark.parametrize(
    "target",
    [
        "tests/ops/test_cuda_ops.py::test_batched_eigh_empty",
        "bench/kernels/bench_kernels_gpu.py::test_covariance",
    ],
)
def test_gpu_checks_fail_when_cuda_kernels_are_missing(target: str) -> None:
    res = _run(target)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert "CUDA device present but" in out, out
    assert "skipped" not in out.split("\n")[-2], out
