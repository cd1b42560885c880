"""GPU tests of the CUDA kernels in kaisa._C (csrc/cuda/*.cu) against the reference ops.

Every test calls ``torch.ops.kaisa.*`` on CUDA tensors directly and compares with
:mod:`kaisa.ops._reference` evaluated in float64 on the same input values. The
whole module is skipped without a CUDA device; with one, a missing extension or
missing CUDA kernels make every test fail with the load error (tests/conftest.py).

Poisoning: before each op call the CUDA caching allocator's free blocks are
filled with NaN (allocate, fill, free), so an output element or workspace
entry that a kernel forgets to write shows up as NaN instead of a stale value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from tests.support.cases import CONV_OP_CASES, ConvOpCase, conv_op_id

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    # tests/conftest.py fails (never skips) these tests when a CUDA device is
    # present but kaisa.ops.cuda_kernels_error() reports missing kernels.
    torch.manual_seed(0)
    yield


DEV = "cuda"

ConvCase = ConvOpCase
CONV_CASES = CONV_OP_CASES

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _rel_tol(dtype: torch.dtype) -> float:
    """Tolerance relative to the largest reference entry."""
    if dtype == torch.float64:
        return 1e-11
    if dtype == torch.float32:
        return 2e-5
    return 1.5e-2  # bf16/fp16: output rounding dominates (fp32 accumulation)


def _assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    assert torch.isfinite(a).all(), "non-finite entries (unwritten output?)"
    scale = max(e.abs().max().item(), 1e-30)
    err = (a - e).abs().max().item()
    assert err <= _rel_tol(dtype) * scale, f"max abs err {err:.3e} vs scale {scale:.3e}"


def _poison_allocator() -> None:
    """Fills free blocks of the caching allocator (small and large pools) with NaN."""
    keep = [torch.full((n,), math.nan, device=DEV) for n in (1 << 8, 1 << 12, 1 << 16, 1 << 18)]
    keep += [torch.full((1 << 22,), math.nan, device=DEV) for _ in range(4)]
    del keep
    torch.cuda.synchronize()


def _rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, device=DEV, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------- #
# covariance
# --------------------------------------------------------------------------- #

LINEAR_SHAPES = [(1, 1), (37, 5), (3, 200), (1000, 130), (5000, 70), (257, 64), (0, 6)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_covariance(shape: tuple[int, int], bias: bool, dtype: torch.dtype) -> None:
    x = _rand(shape, dtype)
    scale = 1.0 / max(shape[0], 1)
    _poison_allocator()
    out = torch.ops.kaisa.covariance(x, scale, bias)
    expected = ref.covariance(x.double(), scale, bias=bias)
    assert out.dtype == dtype and out.is_contiguous()
    assert out.shape == (shape[1] + bias, shape[1] + bias)
    assert torch.equal(out, out.mT), "not exactly symmetric"
    _assert_close_rel(out, expected, dtype)


def test_covariance_noncontiguous_input() -> None:
    base = _rand((50, 90), torch.float32)
    x = base[:, ::3]  # (50, 30), column stride 3
    out = torch.ops.kaisa.covariance(x, 0.5, True)
    _assert_close_rel(out, ref.covariance(x.double(), 0.5, bias=True), torch.float32)


# --------------------------------------------------------------------------- #
# conv_covariance
# --------------------------------------------------------------------------- #


def _conv_ref(x: torch.Tensor, case: ConvCase, bias: bool, scale: float) -> torch.Tensor:
    _, ks, st, pd, dl, g = case
    return ref.conv_covariance(x.double(), ks, st, pd, dl, g, bias, scale)


_ids = conv_op_id


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CONV_CASES, ids=_ids)
def test_conv_covariance(case: ConvCase, bias: bool, dtype: torch.dtype) -> None:
    shape, ks, st, pd, dl, g = case
    x = _rand(shape, dtype)
    scale = 0.37
    _poison_allocator()
    out = torch.ops.kaisa.conv_covariance(x, list(ks), list(st), list(pd), list(dl), g, bias, scale)
    d = shape[1] // g * ks[0] * ks[1] + bias
    assert out.shape == (g, d, d) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, out.mT), "not exactly symmetric"
    _assert_close_rel(out, _conv_ref(x, case, bias, scale), dtype)


def test_conv_covariance_channels_last_input() -> None:
    case = CONV_CASES[0]
    shape, ks, st, pd, dl, g = case
    x = _rand(shape, torch.float32).to(memory_format=torch.channels_last)
    out = torch.ops.kaisa.conv_covariance(x, list(ks), list(st), list(pd), list(dl), g, True, 1.0)
    _assert_close_rel(out, _conv_ref(x, case, True, 1.0), torch.float32)


def test_conv_covariance_resnet_stage_shape() -> None:
    # A full 3x3 ResNet layer2 conv at a small batch: d = 1152 (18 tiles).
    x = _rand((2, 128, 14, 14), torch.float32)
    case: ConvCase = ((2, 128, 14, 14), (3, 3), (1, 1), (1, 1), (1, 1), 1)
    out = torch.ops.kaisa.conv_covariance(x, [3, 3], [1, 1], [1, 1], [1, 1], 1, False, 1 / 392)
    _assert_close_rel(out, _conv_ref(x, case, False, 1 / 392), torch.float32)


def test_ops_backend_ext_matches_torch_on_cuda() -> None:
    """The public kaisa.ops functions dispatch CUDA tensors to these kernels."""
    x = _rand((2, 8, 10, 10), torch.float32)
    args: tuple[Any, ...] = ((3, 3), (1, 1), (1, 1), (1, 1), 2, True, 0.01)
    with ops.use_backend("ext"):
        ext = ops.conv_covariance(x, *args)
    with ops.use_backend("torch"):
        want = ops.conv_covariance(x, *args)
    _assert_close_rel(ext, want.double(), torch.float32)


# --------------------------------------------------------------------------- #
# eigen_precondition
# --------------------------------------------------------------------------- #


def _orth(b: int | None, n: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (n, n) if b is None else (b, n, n)
    q, _ = torch.linalg.qr(torch.randn(shape, device=DEV, dtype=torch.float64))
    return q.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("use_dgda", [False, True])
@pytest.mark.parametrize("dims", [(3, 17, 33), (1, 64, 65), (None, 20, 9), (2, 1, 1), (4, 100, 7)])
def test_eigen_precondition(
    dims: tuple[int | None, int, int], use_dgda: bool, dtype: torch.dtype
) -> None:
    b, m, n = dims
    lead = () if b is None else (b,)
    grad = _rand((*lead, m, n), dtype)
    qa = _orth(b, n, dtype)
    qg = _orth(b, m, dtype)
    da = torch.rand((*lead, n), device=DEV).to(dtype)
    dg = torch.rand((*lead, m), device=DEV).to(dtype)
    damping = 0.03
    if use_dgda:
        dgda = (1.0 / (dg.double().unsqueeze(-1) * da.double().unsqueeze(-2) + damping)).to(dtype)
        expected = ref.eigen_precondition(
            grad.double(), qa.double(), qg.double(), None, None, dgda.double(), damping
        )
        _poison_allocator()
        out = torch.ops.kaisa.eigen_precondition(grad, qa, qg, None, None, dgda, damping)
    else:
        expected = ref.eigen_precondition(
            grad.double(), qa.double(), qg.double(), da.double(), dg.double(), None, damping
        )
        _poison_allocator()
        out = torch.ops.kaisa.eigen_precondition(grad, qa, qg, da, dg, None, damping)
    assert out.shape == grad.shape and out.dtype == dtype and out.is_contiguous()
    # four chained products and a division: looser than the covariance
    tol = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 5e-2}[dtype]
    a = out.double().cpu()
    e = expected.double().cpu()
    scale = max(e.abs().max().item(), 1e-30)
    assert torch.isfinite(a).all()
    assert (a - e).abs().max().item() <= tol * scale


# --------------------------------------------------------------------------- #
# batched_eigh
# --------------------------------------------------------------------------- #


def _spd_batch(b: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(b, n, n + 3, device=DEV, dtype=torch.float64)
    a = x @ x.mT / (n + 3) + 0.1 * torch.eye(n, device=DEV, dtype=torch.float64)
    return a.to(dtype)


EIGH_IMPLS = ["auto", "syevj", "xsyev_batched", "syevd"]


@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n", [7, 32, 33, 100, 577])
def test_batched_eigh(
    n: int, batch: int, dtype: torch.dtype, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(batch, n, dtype)
    _poison_allocator()
    vals, vecs = torch.ops.kaisa.batched_eigh(a)
    assert vals.shape == (batch, n) and vecs.shape == (batch, n, n)
    assert vals.dtype == dtype and vecs.dtype == dtype
    assert vals.is_contiguous() and vecs.is_contiguous()
    v = vecs.double()
    w = vals.double()
    tol = 20 * n * torch.finfo(dtype).eps  # backward-stable solver bound, generous constant
    norm = torch.linalg.matrix_norm(a.double(), ord=2).max().item()
    recon = v @ torch.diag_embed(w) @ v.mT
    assert (recon - a.double()).abs().max().item() <= tol * norm
    eye = torch.eye(n, device=DEV, dtype=torch.float64)
    assert (v.mT @ v - eye).abs().max().item() <= tol
    assert (w[:, 1:] >= w[:, :-1]).all(), "eigenvalues not ascending"
    want = torch.linalg.eigvalsh(a.double())
    assert (w - want).abs().max().item() <= tol * norm


@pytest.mark.parametrize("n", [5, 40])
def test_batched_eigh_unbatched_and_lower_triangle(n: int) -> None:
    a = _spd_batch(1, n, torch.float64)[0]
    junk = a + torch.triu(torch.randn_like(a), diagonal=1)  # only the lower triangle counts
    vals, vecs = torch.ops.kaisa.batched_eigh(junk)
    assert vals.shape == (n,) and vecs.shape == (n, n)
    want_vals = torch.linalg.eigvalsh(junk)  # UPLO='L'
    torch.testing.assert_close(vals, want_vals, rtol=1e-10, atol=1e-10)
    recon = vecs @ torch.diag(vals) @ vecs.mT
    torch.testing.assert_close(recon, a, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("n", [8, 64])
def test_batched_eigh_failure_is_catchable(
    n: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(2, n, torch.float32)
    a[1, 2, 1] = math.nan
    a[1, 1, 2] = math.nan
    with pytest.raises(RuntimeError, match=r"batched_eigh|cusolver"):
        torch.ops.kaisa.batched_eigh(a)
    # the error leaves the device usable
    vals, _ = torch.ops.kaisa.batched_eigh(a[:1].clone())
    assert torch.isfinite(vals).all()


def test_batched_eigh_rejects_bad_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", "magma")
    with pytest.raises(RuntimeError, match="KAISA_EIGH_IMPL"):
        torch.ops.kaisa.batched_eigh(_spd_batch(1, 40, torch.float32))


def test_batched_eigh_empty() -> None:
    vals, vecs = torch.ops.kaisa.batched_eigh(torch.empty(0, 4, 4, device=DEV))
    assert vals.shape == (0, 4) and vecs.shape == (0, 4, 4)


@pytest.mark.parametrize("n", [16, 100])
def test_batched_eigh_on_a_side_stream_and_thread(n: int) -> None:
    """The extension's own cuSOLVER handles follow the current stream and thread."""
    import threading

    a = _spd_batch(3, n, torch.float64)
    want = torch.linalg.eigvalsh(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        vals, _ = torch.ops.kaisa.batched_eigh(a)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(vals, want, rtol=1e-9, atol=1e-9)
    got: list[torch.Tensor] = []
    worker = threading.Thread(target=lambda: got.append(torch.ops.kaisa.batched_eigh(a)[0]))
    worker.start()
    worker.join()
    torch.testing.assert_close(got[0], want, rtol=1e-9, atol=1e-9)


def test_every_op_has_cuda_cpu_and_meta_kernels() -> None:
    for op in ops.OPS:
        assert ops.kernels(op) == ("CPU", "CUDA", "Meta"), op
