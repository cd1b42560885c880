"""The covariance ops' cuBLAS GEMM path (csrc/cuda/covariance.cu) and its cost model.

The same cases as tests/ops/test_cuda_ops.py's covariance tests, with the GEMM path forced
(``KAISA_COVARIANCE_IMPL=gemm``) and a chunk of rows that does not divide the rows
(``KAISA_COVARIANCE_GEMM_ROWS``), against :mod:`kaisa.ops._reference` in float64 under
both thread schedules; then the automatic choice between the fused kernel and the GEMM
path on shapes the cost model puts on either side, and torch's fp32 matmul precision
reaching cuBLAS. Under the emulator the launch log shows which path ran and every
cuBLAS call's arguments (tools/simt/src/cublas.cpp).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from tests.ops.test_cuda_ops import (
    DTYPES,
    LINEAR_SHAPES,
    RANDOM_CONV_CASES,
    RANDOM_LINEAR_SHAPES,
    TF32_REL_TOL,
    _check_conv,
    _check_covariance,
    _rand,
)
from tests.support.backends import Backend
from tests.support.cases import CONV_OP_CASES, ConvOpCase, conv_op_id


@pytest.fixture
def tf32() -> Iterator[None]:
    """torch's fp32 matmul precision 'high' (TF32) for the test, restored afterwards."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _gemm_calls() -> list[dict[str, str]]:
    """The emulator's log of cublasGemmEx calls, each as its ``key=value`` fields."""
    calls = []
    for entry in torch.ops.simt.launch_log():
        if entry.startswith("cublasGemmEx "):
            calls.append(dict(f.split("=", 1) for f in entry.split()[1:]))
    return calls


def _kernels(name: str) -> int:
    return sum(1 for e in torch.ops.simt.launch_log() if e.split()[0] == name)


def _assert_gemm_path(rows: int, d: int, chunk: int, groups: int, pack: bool) -> None:
    """The last run took the GEMM path: one call per chunk and group, beta = 1 after the first."""
    calls = _gemm_calls()
    chunks = math.ceil(rows / chunk)
    assert len(calls) == chunks * groups, torch.ops.simt.launch_log()
    assert _kernels("gram_tile_kernel") == 0
    assert _kernels("pack_patches_kernel") == (chunks * groups if pack else 0)
    assert _kernels("finalize_kernel") == 1
    for i, call in enumerate(calls):
        first = i % chunks == 0
        assert call["beta"] == ("0" if first else "1"), (i, call)
        assert int(call["k"]) == (rows - (chunks - 1) * chunk if i % chunks == chunks - 1
                                  else chunk)
        assert call["m"] == call["n"] == call["lda"] == call["ldb"] == call["ldc"] == str(d)
        assert (call["opA"], call["opB"]) == ("N", "T")


# --------------------------------------------------------------------------- #
# the GEMM path forced, chunks that do not divide the rows
# --------------------------------------------------------------------------- #

GEMM_LINEAR_SHAPES = [shape for shape, _ in LINEAR_SHAPES] + RANDOM_LINEAR_SHAPES


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", GEMM_LINEAR_SHAPES, ids=[f"{r}x{d}" for r, d in GEMM_LINEAR_SHAPES])
def test_covariance_gemm_path(
    backend: Backend, shape: tuple[int, int], bias: bool, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    chunk = 37  # divides none of the row counts above but 37
    monkeypatch.setenv("KAISA_COVARIANCE_GEMM_ROWS", str(chunk))
    rows, d = shape
    _check_covariance(backend, _rand(shape, dtype), bias, 1.0 / max(rows, 1))
    if backend.emulated and d + bias > 0:  # the overflow guard packs rows (scale < 1)
        _assert_gemm_path(rows, d + bias, chunk, 1, pack=bias or rows > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CONV_OP_CASES + RANDOM_CONV_CASES, ids=conv_op_id)
def test_conv_covariance_gemm_path(
    backend: Backend, case: ConvOpCase, bias: bool, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    chunk = 29
    monkeypatch.setenv("KAISA_COVARIANCE_GEMM_ROWS", str(chunk))
    _check_conv(backend, _rand(case[0], dtype), case, bias)
    if backend.emulated:
        shape, ks, st, pd, dl, g = case
        ho, wo = (
            (shape[2 + i] + 2 * pd[i] - dl[i] * (ks[i] - 1) - 1) // st[i] + 1 for i in (0, 1)
        )
        d = shape[1] // g * ks[0] * ks[1] + bias
        _assert_gemm_path(shape[0] * ho * wo, d, chunk, g, pack=True)


def test_covariance_gemm_path_one_chunk_without_a_limit(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Far under the memory bound all rows are one chunk: one GEMM, k = rows."""
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    x = _rand((300, 20), torch.float32)
    _check_covariance(backend, x, True, 0.5)
    if backend.emulated:
        _assert_gemm_path(300, 21, 300, 1, pack=True)


def test_covariance_gemm_path_noncontiguous_and_channels_last(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    monkeypatch.setenv("KAISA_COVARIANCE_GEMM_ROWS", "16")
    _check_covariance(backend, _rand((50, 90), torch.float32)[:, ::3], False, 0.5)
    case = CONV_OP_CASES[0]
    x = _rand(case[0], torch.float32).to(memory_format=torch.channels_last)
    _check_conv(backend, x, case, True)


@pytest.mark.parametrize("name,value", [("KAISA_COVARIANCE_IMPL", "cutlass"),
                                        ("KAISA_COVARIANCE_GEMM_ROWS", "0"),
                                        ("KAISA_COVARIANCE_GEMM_ROWS", "12x")])
def test_covariance_rejects_bad_env(
    backend: Backend, name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=name):
        backend.ops().covariance(backend.to_device(_rand((10, 4), torch.float32)), 1.0, False)


# --------------------------------------------------------------------------- #
# the cost model (KAISA_COVARIANCE_IMPL unset = auto)
# --------------------------------------------------------------------------- #

# A ResNet-like 3x3 conv (d = 576) at two batches. The model's estimates (constants fitted
# on an H100, bench/gpu/fit_cost_model.py), 2048 rows: fused ~81 us; GEMM ~82 us with
# bf16/fp16 tensor cores, ~86 us with TF32, ~107 us with IEEE fp32 (the per-call overhead
# dominates: the fused kernel). 8192 rows: fused ~250 us; GEMM ~104 us (16-bit), ~126 us
# (TF32), ~205 us (IEEE fp32: cuBLAS's fp32 GEMM runs at 0.7 of the FMA peak, the fused
# kernel at 0.2), so every precision takes the GEMM path.
SMALL_CASE: ConvOpCase = ((8, 64, 16, 16), (3, 3), (1, 1), (1, 1), (1, 1), 1)
RESNET_CASE: ConvOpCase = ((32, 64, 16, 16), (3, 3), (1, 1), (1, 1), (1, 1), 1)


def _auto_conv(backend: Backend, dtype: torch.dtype, case: ConvOpCase) -> bool:
    """Runs the case under the automatic choice; whether it took the GEMM path."""
    _check_conv(backend, _rand(case[0], dtype), case, False)
    gemm = _kernels("gram_tile_kernel") == 0
    assert gemm == bool(_gemm_calls())
    return gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cost_model_takes_tensor_cores_for_16_bit_inputs(
    backend: Backend, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    if not backend.emulated:
        _check_conv(backend, _rand(RESNET_CASE[0], dtype), RESNET_CASE, False)
        return
    assert _auto_conv(backend, dtype, RESNET_CASE)
    (call,) = _gemm_calls()
    assert call["A"] == {torch.bfloat16: "16BF", torch.float16: "16F"}[dtype]
    assert (call["C"], call["compute"]) == ("32F", "32F")  # fp32 accumulation


def test_cost_model_takes_cublas_ieee_fp32_for_large_work(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured on an H100: cuBLAS's IEEE fp32 GEMM beats the fused kernel once the work
    hides the per-call overhead, although it computes both triangles."""
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    assert torch.get_float32_matmul_precision() == "highest"
    if not backend.emulated:
        _check_conv(backend, _rand(RESNET_CASE[0], torch.float32), RESNET_CASE, False)
        return
    assert _auto_conv(backend, torch.float32, RESNET_CASE)
    (call,) = _gemm_calls()
    assert (call["A"], call["compute"]) == ("32F", "32F")


def test_cost_model_keeps_the_fused_kernel_for_small_ieee_fp32_work(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At small work the per-call overhead of the GEMM path (three calls) decides."""
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    assert torch.get_float32_matmul_precision() == "highest"
    if not backend.emulated:
        _check_conv(backend, _rand(SMALL_CASE[0], torch.float32), SMALL_CASE, False)
        return
    assert not _auto_conv(backend, torch.float32, SMALL_CASE)


@pytest.mark.usefixtures("tf32")
def test_cost_model_takes_tf32_when_torch_allows_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    if not backend.emulated:  # a real GPU's TF32 rounds the inputs to 10-bit mantissas
        _check_conv(backend, _rand(RESNET_CASE[0], torch.float32), RESNET_CASE, False,
                    rel_tol=TF32_REL_TOL)
        return
    assert _auto_conv(backend, torch.float32, RESNET_CASE)
    (call,) = _gemm_calls()
    assert (call["A"], call["compute"], call["math"]) == ("32F", "32F_FAST_TF32", "TF32_TENSOR_OP")


@pytest.mark.parametrize("scale", [1.0, 1.0 / 8192])
def test_cost_model_linear_layer_reads_x_directly_without_a_guard(
    backend: Backend, scale: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large linear factor in bf16 with no overflow guard (a scale of 1) takes the GEMM
    path with x itself as P; with one (a scale below 1) rows reach cuBLAS only packed,
    scaled by the guard's factor as they are copied (or the fused kernel runs)."""
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    x = _rand((8192, 256), torch.bfloat16)
    _check_covariance(backend, x, False, scale)
    if not backend.emulated:
        return
    if scale == 1.0:
        _assert_gemm_path(8192, 256, 8192, 1, pack=False)
    else:  # the copy costs what it costs (the model weighs it): never x unscaled to cuBLAS
        assert not _gemm_calls() or _kernels("pack_patches_kernel") > 0


@pytest.mark.parametrize("case", [
    ((2, 6, 9, 9), (3, 3), (1, 1), (1, 1), (1, 1), 6),  # depthwise: one GEMM per group
    ((2, 8, 6, 6), (3, 3), (1, 1), (1, 1), (1, 1), 1),  # small: launch costs dominate
], ids=conv_op_id)
def test_cost_model_keeps_small_and_depthwise_convs_fused(
    backend: Backend, case: ConvOpCase, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAISA_COVARIANCE_IMPL", raising=False)
    if not backend.emulated:
        pytest.skip("reads the emulator's launch log")
    assert not _auto_conv(backend, torch.bfloat16, case)


def test_covariance_gemm_path_fp64_uses_fp64_compute(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "gemm")
    _check_covariance(backend, _rand((64, 9), torch.float64), True, 0.1)
    if backend.emulated:
        (call,) = _gemm_calls()
        assert (call["A"], call["C"], call["compute"]) == ("64F", "64F", "64F")
