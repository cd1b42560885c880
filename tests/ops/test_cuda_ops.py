"""The CUDA kernels of csrc/cuda/*.cu against the reference ops, on a GPU or emulated.

Every case calls the kernels (``torch.ops.kaisa.*`` on a GPU, ``torch.ops.kaisa_simt.*``
under the SIMT emulator of tools/simt, which compiles the same unmodified sources as
host C++: tests/support/backends.py) and compares with :mod:`kaisa.ops._reference`
evaluated in float64 on the same input values. Each case runs twice: under the
emulator with the two thread schedules (ascending, descending), whose results must be
bit for bit equal (a race between threads shows up as a difference, or as poison);
on a GPU twice in a row. Fresh device memory holds NaN (poisoned), so an output or
workspace element a kernel forgets to write shows up.

A machine with a CUDA device runs the GPU; a missing extension or missing CUDA kernels
then fail every case (tests/conftest.py). Elsewhere the emulator runs (CI).
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from tests.support.backends import Backend
from tests.support.cases import CONV_OP_CASES, ConvOpCase, conv_op_id

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _rel_tol(dtype: torch.dtype) -> float:
    """Tolerance relative to the largest reference entry."""
    if dtype == torch.float64:
        return 1e-11
    if dtype == torch.float32:
        return 2e-5
    return 1.5e-2  # bf16/fp16: output rounding dominates (fp32 accumulation)


TF32_REL_TOL = 3e-3
"""Tolerance of fp32 results computed with TF32 tensor cores (10-bit mantissas)."""


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                      rel_tol: float | None = None) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite entries (unwritten output?)"
    scale = max(e.abs().max().item(), 1e-30) if e.numel() else 1.0
    err = (a - e).abs().max().item() if e.numel() else 0.0
    tol = _rel_tol(dtype) if rel_tol is None else rel_tol
    assert err <= tol * scale, f"max abs err {err:.3e} vs scale {scale:.3e}"


def _runs(backend: Backend, call: Callable[[], Any]) -> list[Any]:
    """Both runs of ``call``; under the emulator they must agree bit for bit."""
    runs = backend.runs(call)
    if backend.emulated:
        first, second = runs
        pairs = zip(first, second) if isinstance(first, tuple) else [(first, second)]
        for a, b in pairs:
            assert torch.equal(a, b), "results differ between the two thread schedules"
    return runs


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------- #
# covariance
# --------------------------------------------------------------------------- #

# (rows, d), whether the emulated H200 (132 SMs) splits the rows (split-K).
LINEAR_SHAPES: list[tuple[tuple[int, int], bool]] = [
    ((1, 1), False),
    ((37, 5), False),
    ((3, 200), False),  # 4 tiles, ragged
    ((1000, 130), True),
    ((5000, 70), True),
    ((257, 64), False),  # exactly one tile, 9 row chunks
    ((0, 6), False),  # no rows: zeros
    ((700, 1), True),
    ((480, 63), False),  # 15 row chunks: one short of the split threshold
    ((512, 65), True),  # 16 row chunks, a 1-column second tile
]
_rng = random.Random(26)
RANDOM_LINEAR_SHAPES: list[tuple[int, int]] = [
    (_rng.randint(1, 900), _rng.randint(1, 150)) for _ in range(6)
]


def _check_covariance(backend: Backend, x: torch.Tensor, bias: bool, scale: float) -> None:
    dtype = x.dtype
    runs = _runs(backend, lambda: backend.ops().covariance(backend.to_device(x), scale, bias))
    expected = ref.covariance(x.double(), scale, bias=bias)
    d = x.shape[1] + bias
    for out in runs:
        assert out.dtype == dtype and out.is_contiguous() and out.shape == (d, d)
        assert torch.equal(out, out.mT), "not exactly symmetric"
        _assert_close_rel(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape,split", LINEAR_SHAPES, ids=[f"{r}x{d}" for (r, d), _ in LINEAR_SHAPES])
def test_covariance(
    backend: Backend, shape: tuple[int, int], split: bool, bias: bool, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "fused")  # the GEMM path: its own test file
    _check_covariance(backend, _rand(shape, dtype), bias, 1.0 / max(shape[0], 1))
    if backend.emulated and shape[1] + bias > 0:
        (grid,) = backend.launches("gram_tile_kernel")
        assert (grid[2] > 1) == split, f"split-K {'off' if split else 'on'}: grid {grid}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RANDOM_LINEAR_SHAPES, ids=[f"{r}x{d}" for r, d in RANDOM_LINEAR_SHAPES])
def test_covariance_random_shapes(backend: Backend, shape: tuple[int, int], dtype: torch.dtype) -> None:
    _check_covariance(backend, _rand(shape, dtype), shape[0] % 2 == 0, 0.25)


def test_covariance_noncontiguous_input(backend: Backend) -> None:
    x = _rand((50, 90), torch.float32)[:, ::3]  # (50, 30), column stride 3
    _check_covariance(backend, x, True, 0.5)


# --------------------------------------------------------------------------- #
# the overflow guard inside the kernels


@pytest.mark.parametrize("impl", ["fused", "gemm"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [8, 600])  # 600: split-K on the emulated H200 (fused)
def test_covariance_whose_sum_overflows_is_finite(
    backend: Backend, impl: str, bias: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs of 1.2e19: every entry of X^T X / M is 1.44e38 (finite in float32), the sum
    before its 1/M is not; the kernel scales the loaded elements by sqrt(1/M) itself."""
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", impl)
    v = 1.2e19
    x = torch.full((rows, 3), v)
    x[::2, 1] = -v  # the guard reads the minimum too
    for out in _runs(backend, lambda: backend.ops().covariance(backend.to_device(x), 1.0 / rows,
                                                                bias)):
        expected = ref.covariance(x.double(), 1.0 / rows, bias=bias)
        assert torch.equal(out, out.mT)
        _assert_close_rel(out, expected, torch.float32)
        if bias:  # the ones are scaled with the rest: the corner is 1 up to rounding
            assert out[-1, -1].item() == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("impl", ["fused", "gemm"])
def test_conv_covariance_whose_sum_overflows_is_finite(
    backend: Backend, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", impl)
    case: ConvOpCase = ((2, 4, 5, 5), (3, 3), (1, 1), (1, 1), (1, 1), 2)
    x = torch.full(case[0], 1.2e19)
    scale = 1.0 / (2 * 25)
    runs = _runs(backend, lambda: backend.ops().conv_covariance(
        backend.to_device(x), [3, 3], [1, 1], [1, 1], [1, 1], 2, True, scale))
    expected = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 2, True, scale)
    for out in runs:
        _assert_close_rel(out, expected, torch.float32)


def test_a_safe_input_is_not_scaled_and_a_nan_stays(backend: Backend) -> None:
    """Without risk the guard's factor is 1 (the same bits as no guard); NaN is not risk."""
    x = _rand((40, 6), torch.float32)
    got = backend.ops().covariance(backend.to_device(x), 1.0 / 40, True).cpu()
    unguarded = backend.ops().covariance(backend.to_device(x), 1.0, True).cpu() / 40
    torch.testing.assert_close(got, unguarded, rtol=1e-6, atol=0.0)
    x[3, 2] = float("nan")
    got = backend.ops().covariance(backend.to_device(x), 1.0 / 40, False).cpu()
    assert bool(got[2].isnan().all()) and bool(torch.isfinite(got[0, :2]).all())


# --------------------------------------------------------------------------- #
# conv_covariance
# --------------------------------------------------------------------------- #


def _random_conv_case(rng: random.Random) -> ConvOpCase:
    g = rng.choice([1, 1, 2, 3])
    c = g * rng.randint(1, 6)
    ks = (rng.randint(1, 4), rng.randint(1, 4))
    st = (rng.randint(1, 3), rng.randint(1, 3))
    dl = (rng.randint(1, 2), rng.randint(1, 2))
    pd = (rng.randint(0, 2), rng.randint(0, 2))
    span = [dl[i] * (ks[i] - 1) + 1 for i in (0, 1)]
    hw = [max(span[i] - 2 * pd[i], 1) + rng.randint(0, 9) for i in (0, 1)]
    return ((rng.randint(1, 3), c, hw[0], hw[1]), ks, st, pd, dl, g)


RANDOM_CONV_CASES: list[ConvOpCase] = [_random_conv_case(_rng) for _ in range(6)]


def _check_conv(backend: Backend, x: torch.Tensor, case: ConvOpCase, bias: bool,
                rel_tol: float | None = None) -> None:
    shape, ks, st, pd, dl, g = case
    scale = 0.37
    dtype = x.dtype
    runs = _runs(
        backend,
        lambda: backend.ops().conv_covariance(
            backend.to_device(x), list(ks), list(st), list(pd), list(dl), g, bias, scale
        ),
    )
    expected = ref.conv_covariance(x.double(), ks, st, pd, dl, g, bias, scale)
    d = shape[1] // g * ks[0] * ks[1] + bias
    for out in runs:
        assert out.shape == (g, d, d) and out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, out.mT), "not exactly symmetric"
        _assert_close_rel(out, expected, dtype, rel_tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CONV_OP_CASES + RANDOM_CONV_CASES, ids=conv_op_id)
def test_conv_covariance(backend: Backend, case: ConvOpCase, bias: bool, dtype: torch.dtype) -> None:
    _check_conv(backend, _rand(case[0], dtype), case, bias)


def test_conv_covariance_channels_last_input(backend: Backend) -> None:
    case = CONV_OP_CASES[0]
    x = _rand(case[0], torch.float32).to(memory_format=torch.channels_last)
    _check_conv(backend, x, case, True)


def test_conv_covariance_resnet_stage_shape(backend: Backend) -> None:
    # A full 3x3 ResNet layer2 conv at a small batch: d = 1152 (18 tiles, 171 tile pairs).
    case: ConvOpCase = ((2, 128, 14, 14), (3, 3), (1, 1), (1, 1), (1, 1), 1)
    _check_conv(backend, _rand(case[0], torch.float32), case, False)


@pytest.mark.parametrize("split", [False, True])
def test_conv_covariance_split_k(
    backend: Backend, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stem conv (d = 147, 6 tile pairs) splits its 1352 rows on a large GPU only."""
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "fused")
    case: ConvOpCase = ((2, 3, 52, 52), (7, 7), (2, 2), (3, 3), (1, 1), 1)
    if not backend.emulated:
        _check_conv(backend, _rand(case[0], torch.float32), case, True)
        return
    previous = torch.ops.simt.set_sm_count(132 if split else 1)
    try:
        _check_conv(backend, _rand(case[0], torch.float32), case, True)
        (grid,) = backend.launches("gram_tile_kernel")
    finally:
        torch.ops.simt.set_sm_count(previous)
    assert (grid[2] > 1) == split, grid


@pytest.mark.gpu
def test_ops_backend_ext_matches_torch_on_cuda() -> None:
    """The public kaisa.ops functions dispatch CUDA tensors to these kernels."""
    x = _rand((2, 8, 10, 10), torch.float32).to("cuda")
    args: tuple[Any, ...] = ((3, 3), (1, 1), (1, 1), (1, 1), 2, True, 0.01)
    with ops.use_backend("ext"):
        ext = ops.conv_covariance(x, *args)
    with ops.use_backend("torch"):
        want = ops.conv_covariance(x, *args)
    _assert_close_rel(ext, want.double(), torch.float32)


@pytest.mark.gpu
def test_every_op_has_cuda_cpu_and_meta_kernels() -> None:
    for op in ops.OPS:
        assert ops.kernels(op) == ("CPU", "CUDA", "Meta"), op


# --------------------------------------------------------------------------- #
# eigen_precondition
# --------------------------------------------------------------------------- #


def _orth(b: int | None, n: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (n, n) if b is None else (b, n, n)
    q, _ = torch.linalg.qr(torch.randn(shape, dtype=torch.float64))
    return q.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_dgda", [False, True])
@pytest.mark.parametrize("dims", [(3, 17, 33), (1, 64, 65), (None, 20, 9), (2, 1, 1), (4, 100, 7)])
def test_eigen_precondition(
    backend: Backend, dims: tuple[int | None, int, int], use_dgda: bool, dtype: torch.dtype
) -> None:
    b, m, n = dims
    lead = () if b is None else (b,)
    grad = _rand((*lead, m, n), dtype)
    qa = _orth(b, n, dtype)
    qg = _orth(b, m, dtype)
    da = torch.rand((*lead, n)).to(dtype)
    dg = torch.rand((*lead, m)).to(dtype)
    damping = 0.03
    dev = backend.to_device
    if use_dgda:
        dgda = (1.0 / (dg.double().unsqueeze(-1) * da.double().unsqueeze(-2) + damping)).to(dtype)
        expected = ref.eigen_precondition(
            grad.double(), qa.double(), qg.double(), None, None, dgda.double(), damping
        )
        runs = _runs(backend, lambda: backend.ops().eigen_precondition(
            dev(grad), dev(qa), dev(qg), None, None, dev(dgda), damping))
    else:
        expected = ref.eigen_precondition(
            grad.double(), qa.double(), qg.double(), da.double(), dg.double(), None, damping
        )
        runs = _runs(backend, lambda: backend.ops().eigen_precondition(
            dev(grad), dev(qa), dev(qg), dev(da), dev(dg), None, damping))
    # four chained products and a division: looser than the covariance
    tol = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 5e-2,
           torch.float16: 1e-2}[dtype]
    for out in runs:
        assert out.shape == grad.shape and out.dtype == dtype and out.is_contiguous()
        a = out.double()
        scale = max(expected.abs().max().item(), 1e-30)
        assert torch.isfinite(a).all()
        assert (a - expected).abs().max().item() <= tol * scale


# --------------------------------------------------------------------------- #
# batched_eigh
# --------------------------------------------------------------------------- #


def _spd_batch(b: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(b, n, n + 3, dtype=torch.float64)
    a = x @ x.mT / (n + 3) + 0.1 * torch.eye(n, dtype=torch.float64)
    return a.to(dtype)


EIGH_IMPLS = ["auto", "syevj", "xsyev_batched", "syevd"]


def _check_eigh(a: torch.Tensor, vals: torch.Tensor, vecs: torch.Tensor) -> None:
    batch, n = a.shape[0], a.shape[-1]
    dtype = a.dtype
    assert vals.shape == (batch, n) and vecs.shape == (batch, n, n)
    assert vals.dtype == dtype and vecs.dtype == dtype
    assert vals.is_contiguous() and vecs.is_contiguous()
    v = vecs.double()
    w = vals.double()
    tol = 20 * n * torch.finfo(dtype).eps  # backward-stable solver bound, generous constant
    norm = torch.linalg.matrix_norm(a.double(), ord=2).max().item()
    recon = v @ torch.diag_embed(w) @ v.mT
    assert (recon - a.double()).abs().max().item() <= tol * norm
    eye = torch.eye(n, dtype=torch.float64)
    assert (v.mT @ v - eye).abs().max().item() <= tol
    assert (w[:, 1:] >= w[:, :-1]).all(), "eigenvalues not ascending"
    want = torch.linalg.eigvalsh(a.double())
    assert (w - want).abs().max().item() <= tol * norm


@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n", [7, 32, 33, 100, 577])
def test_batched_eigh(
    backend: Backend, n: int, batch: int, dtype: torch.dtype, impl: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(batch, n, dtype)
    for vals, vecs in _runs(backend, lambda: backend.ops().batched_eigh(backend.to_device(a))):
        _check_eigh(a, vals, vecs)


@pytest.mark.parametrize(("n", "batch", "routine"), [
    (100, 3, "XsyevBatched"),   # n <= 512: the batched routine at any batch
    (577, 3, "syevd"),          # few large matrices: one syevd each (measured on an H100)
    (577, 8, "XsyevBatched"),   # enough of them: batched again
])
def test_batched_eigh_chooses_the_routine_by_size_and_batch(
    backend: Backend, n: int, batch: int, routine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not backend.emulated:
        pytest.skip("the routine is read from the emulator's call log")
    monkeypatch.delenv("KAISA_EIGH_IMPL", raising=False)
    a = _spd_batch(batch, n, torch.float32)
    for vals, vecs in _runs(backend, lambda: backend.ops().batched_eigh(backend.to_device(a))):
        _check_eigh(a, vals, vecs)
        called = {e.split()[0] for e in torch.ops.simt.launch_log()}
        assert routine in called and not ({"syevd", "XsyevBatched"} - {routine}) & called


@pytest.mark.parametrize("n", [5, 40])
def test_batched_eigh_unbatched_and_lower_triangle(backend: Backend, n: int) -> None:
    a = _spd_batch(1, n, torch.float64)[0]
    junk = a + torch.triu(torch.randn_like(a), diagonal=1)  # only the lower triangle counts
    for vals, vecs in _runs(backend, lambda: backend.ops().batched_eigh(backend.to_device(junk))):
        assert vals.shape == (n,) and vecs.shape == (n, n)
        torch.testing.assert_close(vals, torch.linalg.eigvalsh(junk), rtol=1e-10, atol=1e-10)
        recon = vecs @ torch.diag(vals) @ vecs.mT
        torch.testing.assert_close(recon, a, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("garbage", [False, True], ids=["nan_results", "finite_garbage"])
@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("n", [8, 64])
def test_batched_eigh_failure_is_catchable(
    backend: Backend, n: int, impl: str, garbage: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN input raises, whatever the solver makes of it (see ``solver_nan_garbage``)."""
    if garbage and not backend.emulated:
        pytest.skip("the real solver's NaN behaviour is the one case")
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(2, n, torch.float32)
    a[1, 2, 1] = math.nan
    a[1, 1, 2] = math.nan
    with backend.solver_nan_garbage(garbage), pytest.raises(
            RuntimeError, match=r"batched_eigh|cusolver"):
        backend.ops().batched_eigh(backend.to_device(a))
    # the error leaves the device usable
    vals, _ = backend.ops().batched_eigh(backend.to_device(a[:1].clone()))
    assert torch.isfinite(vals.cpu()).all()


_ROUTINES = {"syevj": "syevjBatched", "xsyev_batched": "XsyevBatched", "syevd": "syevd"}


@pytest.mark.parametrize("code", [-5, 3])
@pytest.mark.parametrize("impl", ["syevj", "xsyev_batched", "syevd"])
def test_batched_eigh_reports_info_codes(
    backend: Backend, impl: str, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A solver's nonzero info fails the op even when every result is finite."""
    if not backend.emulated:
        pytest.skip("info codes are injected by the emulator's cuSOLVER")
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    n = 8 if impl == "syevj" else 40
    a = _spd_batch(3, n, torch.float64)
    torch.ops.simt.inject_solver_info(_ROUTINES[impl], 2, code)
    with pytest.raises(torch.linalg.LinAlgError, match=r"failed for 1 of 3 matrices; first "
                       r"failure: matrix 2: .*(parameter 5|info=3)"):
        backend.ops().batched_eigh(backend.to_device(a))


_XSYEV_LIMIT = 6 * 40 * 40  # n * lda * batch of six 40 x 40 matrices


def _xsyev_batches() -> list[int]:
    log = torch.ops.simt.launch_log()
    return [int(e.split("batch=")[1].split()[0]) for e in log if e.startswith("XsyevBatched")]


@pytest.mark.parametrize("batch,calls", [(6, [6]), (7, [6, 1]), (13, [6, 6, 1])])
def test_xsyev_batched_chunks_under_the_element_limit(
    backend: Backend, batch: int, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuSOLVER allows n * lda * batch <= INT32_MAX per call; scaled down to six n = 40 matrices.

    The emulator's solver rejects a call over the same (lowered) limit, as cuSOLVER does.
    """
    monkeypatch.setenv("KAISA_EIGH_IMPL", "xsyev_batched")
    monkeypatch.setenv("KAISA_XSYEV_MAX_ELEMENTS", str(_XSYEV_LIMIT))
    a = _spd_batch(batch, 40, torch.float64)
    previous = torch.ops.simt.set_xsyev_max_elements(_XSYEV_LIMIT) if backend.emulated else 0
    try:
        runs = _runs(backend, lambda: backend.ops().batched_eigh(backend.to_device(a)))
        if backend.emulated:
            assert _xsyev_batches() == calls
    finally:
        if backend.emulated:
            torch.ops.simt.set_xsyev_max_elements(previous)
    for vals, vecs in runs:
        _check_eigh(a, vals, vecs)


def test_emulated_xsyev_batched_rejects_a_call_over_its_limit(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boundary itself: n * lda * batch == limit is accepted, one matrix more is not."""
    if not backend.emulated:
        pytest.skip("the emulator's solver limit")
    monkeypatch.setenv("KAISA_EIGH_IMPL", "xsyev_batched")  # kaisa's own limit stays INT32_MAX
    previous = torch.ops.simt.set_xsyev_max_elements(_XSYEV_LIMIT)
    try:
        backend.ops().batched_eigh(backend.to_device(_spd_batch(6, 40, torch.float64)))
        with pytest.raises(torch.linalg.LinAlgError, match="CUSOLVER_STATUS_INVALID_VALUE"):
            backend.ops().batched_eigh(backend.to_device(_spd_batch(7, 40, torch.float64)))
    finally:
        torch.ops.simt.set_xsyev_max_elements(previous)


def test_xsyev_max_elements_must_be_positive(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_XSYEV_MAX_ELEMENTS", "0")
    with pytest.raises(RuntimeError, match="KAISA_XSYEV_MAX_ELEMENTS"):
        backend.ops().batched_eigh(backend.to_device(_spd_batch(2, 40, torch.float32)))


def test_batched_eigh_rejects_bad_env(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", "magma")
    with pytest.raises(RuntimeError, match="KAISA_EIGH_IMPL"):
        backend.ops().batched_eigh(backend.to_device(_spd_batch(1, 40, torch.float32)))


def test_batched_eigh_empty(backend: Backend) -> None:
    vals, vecs = backend.ops().batched_eigh(backend.to_device(torch.empty(0, 4, 4)))
    assert vals.shape == (0, 4) and vecs.shape == (0, 4, 4)


@pytest.mark.parametrize("n", [16, 100])
def test_batched_eigh_on_a_side_stream_and_thread(backend: Backend, n: int) -> None:
    """The extension's own cuSOLVER handles follow the current stream and thread."""
    a = _spd_batch(3, n, torch.float64)
    want = torch.linalg.eigvalsh(a)
    ad = backend.to_device(a)
    backend.synchronize()
    with backend.stream():
        vals = backend.ops().batched_eigh(ad)[0].cpu()
    torch.testing.assert_close(vals, want, rtol=1e-9, atol=1e-9)
    got: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: got.append(backend.ops().batched_eigh(ad)[0].cpu()))
    worker.start()
    worker.join()
    torch.testing.assert_close(got[0], want, rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- #
# fold
# --------------------------------------------------------------------------- #

# Shapes: one element, a ragged factor, empty, and (for the first fold only: the emulator
# takes seconds a pass) more elements than one grid pass covers (4096 blocks of 256 threads).
FOLD_BRANCHES = [(-1, None), (4, None), (-1, math.nan), (4, math.inf)]
FOLD_CASES = [(shape, stamp, bad) for shape in [(1, 1, 1), (3, 7, 7), (0, 4, 4)]
              for stamp, bad in FOLD_BRANCHES] + [((2, 1100, 1000), -1, None)]


def _fold_lists(backend: Backend, running: list[torch.Tensor], batch: list[torch.Tensor],
                stamp: list[torch.Tensor], skipped: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The list op on device copies; its three result lists flattened (one tuple)."""
    dev = backend.to_device
    outs = backend.ops().fold([dev(t) for t in running], [dev(t) for t in batch],
                              [dev(t) for t in stamp], [dev(t) for t in skipped], 4, 0.95,
                              0.05 / 3)
    return tuple(t for ts in outs for t in ts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "stamp", "bad"), FOLD_CASES, ids=str)
def test_fold(backend: Backend, dtype: torch.dtype, shape: tuple[int, ...], stamp: int,
              bad: float | None) -> None:
    """Bit for bit the reference (no fused multiply-add), the flags read on the device."""
    running = _rand(shape, dtype)
    batch = _rand(shape, dtype)
    if bad is not None and batch.numel():
        batch.view(-1)[-1] = bad  # the last element: the grid-stride loop's far end
    st, sk = torch.tensor(stamp), torch.tensor(7)
    runs = _runs(backend, lambda: _fold_lists(backend, [running], [batch], [st], [sk]))
    want = ref.fold(running, batch, st, sk, 4, 0.95, 0.05 / 3)
    for got in runs:
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.cpu(), w), (g, w)


# A block's two sides (A not finite, G folded), a list of mixed shapes (one empty, one
# non-contiguous), and lists longer than the kernels' chunk of 8 tensors (two launches each
# of the finiteness and update kernels; the second chunk partly full, or full).
FOLD_LISTS = {
    "a_and_g": [(1, 9, 9), (1, 4, 4)],
    "mixed": [(3, 7, 7), (0, 4, 4), (5,), (2, 33), (1, 30, 30)],
    "11": [(2, k % 4 + 1, k % 4 + 1) for k in range(11)],
    "16": [(k % 3 + 1, 3) for k in range(16)],
}
FOLD_LIST_BRANCHES = [(-1, math.nan), (4, None), (-1, None), (4, math.inf), (-1, -math.inf)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(FOLD_LISTS))
def test_fold_lists(backend: Backend, dtype: torch.dtype, name: str) -> None:
    """Each tensor bit for bit its own reference fold, in one fill and two launches a chunk."""
    running, batch, stamps, counts = [], [], [], []
    for i, shape in enumerate(FOLD_LISTS[name]):
        stamp, bad = FOLD_LIST_BRANCHES[i % len(FOLD_LIST_BRANCHES)]
        r, b = _rand(shape, dtype), _rand(shape, dtype)
        if bad is not None and b.numel():
            b.view(-1)[-1] = bad
        if i == 3 and name == "mixed":
            r, b = r.t(), b.t()  # non-contiguous
        running.append(r)
        batch.append(b)
        stamps.append(torch.tensor(stamp))
        counts.append(torch.tensor(i))
    runs = _runs(backend, lambda: _fold_lists(backend, running, batch, stamps, counts))
    want = [ref.fold(r.contiguous(), b.contiguous(), st, sk, 4, 0.95, 0.05 / 3)
            for r, b, st, sk in zip(running, batch, stamps, counts, strict=True)]
    n = len(running)
    for got in runs:
        assert len(got) == 3 * n
        for i, w in enumerate(want):
            for g, wt in zip(got[i::n], w, strict=True):
                assert torch.equal(g.cpu(), wt), (i, g, wt)
                assert g.is_contiguous()
    if backend.emulated:
        chunks = [min(8, n - first) for first in range(0, n, 8)]
        for kernel in ("nonfinite_kernel", "fold_kernel"):
            assert [y for _, y, _ in backend.launches(kernel)] == chunks, kernel


def test_fold_rejects_bad_arguments(backend: Backend) -> None:
    dev = backend.to_device
    r, st = dev(torch.ones(2, 3, 3)), dev(torch.tensor(0))
    with pytest.raises(RuntimeError, match="kaisa fold: batch must have running's shape"):
        backend.ops().fold([r], [dev(torch.ones(2, 3))], [st], [st], 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="skipped must be a 0-d int64 tensor at index 1"):
        backend.ops().fold([r, r], [r, r], [st, st], [st, dev(torch.zeros(1, dtype=torch.int64))],
                           0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="must be lists of one length, got 2, 1, 2 and 2"):
        backend.ops().fold([r, r], [r], [st, st], [st, st], 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="running must have one dtype: Float at index 0"):
        r64 = dev(torch.ones(2, 3, 3, dtype=torch.float64))
        backend.ops().fold([r, r64], [r, r64], [st, st], [st, st], 0, 0.9, 0.1)
