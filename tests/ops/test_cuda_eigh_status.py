"""``kaisa::batched_eigh_status``: the eigendecomposition that leaves its status on the device.

The CUDA kernel (on a GPU, or the same source under the SIMT emulator: see
tests/ops/test_cuda_ops.py) against :func:`kaisa.ops._reference.eigh_status`, under both
thread schedules; the CPU kernel and the wrapper against the same reference.
"""

from __future__ import annotations

import math

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from tests.ops.test_cuda_ops import EIGH_IMPLS, _check_eigh, _runs, _spd_batch
from tests.support.backends import Backend

_ROUTINES = {"syevj": "syevjBatched", "xsyev_batched": "XsyevBatched", "syevd": "syevd"}


def _failed(status: torch.Tensor) -> list[bool]:
    """Per matrix: whether its ``[info, non-finite]`` row reports a failure."""
    return [bool(f) for f in status.reshape(-1, 2).ne(0).any(dim=-1)]


@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("n", [7, 33, 100])
def test_batched_eigh_status_matches_the_reference(
    backend: Backend, n: int, batch: int, dtype: torch.dtype, impl: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(batch, n, dtype)
    want_vals, _, want_status = ref.eigh_status(a.double())
    runs = _runs(backend, lambda: backend.ops().batched_eigh_status(backend.to_device(a)))
    for vals, vecs, status in runs:
        assert status.dtype == torch.int32 and status.shape == (batch, 2)
        assert torch.equal(status, want_status)
        _check_eigh(a, vals, vecs)
        tol = 20 * n * torch.finfo(dtype).eps * want_vals.abs().max().item()
        assert (vals.double() - want_vals).abs().max().item() <= tol


@pytest.mark.parametrize("n", [5, 40])
def test_batched_eigh_status_unbatched(backend: Backend, n: int) -> None:
    a = _spd_batch(1, n, torch.float64)[0]
    want_vals, _, want_status = ref.eigh_status(a)
    for vals, vecs, status in _runs(
        backend, lambda: backend.ops().batched_eigh_status(backend.to_device(a))
    ):
        assert vals.shape == (n,) and vecs.shape == (n, n) and status.shape == (2,)
        assert torch.equal(status, want_status)
        torch.testing.assert_close(vals, want_vals, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(vecs @ torch.diag(vals) @ vecs.mT, a, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("garbage", [False, True], ids=["nan_results", "finite_garbage"])
@pytest.mark.parametrize("impl", EIGH_IMPLS)
@pytest.mark.parametrize("n", [8, 64])
def test_batched_eigh_status_flags_a_non_finite_matrix(
    backend: Backend, n: int, impl: str, garbage: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN input: that matrix's row fails, the others succeed, nothing is raised, whatever
    the solver makes of the NaN (the kernel flags the matrix from its input)."""
    if garbage and not backend.emulated:
        pytest.skip("the real solver's NaN behaviour is the one case")
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(3, n, torch.float32)
    a[1, 2, 1] = a[1, 1, 2] = math.nan
    want = _failed(ref.eigh_status(a.double())[2])
    assert want == [False, True, False]
    with backend.solver_nan_garbage(garbage):
        runs = backend.runs(lambda: backend.ops().batched_eigh_status(backend.to_device(a)))
    if backend.emulated:  # the schedules agree bit for bit, NaN included
        for x, y in zip(*runs, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
    for vals, vecs, status in runs:
        assert _failed(status) == want
        _check_eigh(a[0::2], vals[0::2].contiguous(), vecs[0::2].contiguous())


@pytest.mark.parametrize("code", [-5, 3])
@pytest.mark.parametrize("impl", ["syevj", "xsyev_batched", "syevd"])
def test_batched_eigh_status_carries_the_info_code(
    backend: Backend, impl: str, code: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A solver's nonzero info lands in column 0 of its matrix's row (results finite)."""
    if not backend.emulated:
        pytest.skip("info codes are injected by the emulator's cuSOLVER")
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    n = 8 if impl == "syevj" else 40
    a = _spd_batch(3, n, torch.float64)
    torch.ops.simt.inject_solver_info(_ROUTINES[impl], 2, code)
    _, _, status = backend.ops().batched_eigh_status(backend.to_device(a))
    assert status.cpu().tolist() == [[0, 0], [0, 0], [code, 0]]


@pytest.mark.parametrize("impl", ["syevj", "xsyev_batched", "syevd"])
def test_batched_eigh_status_does_not_synchronise(
    backend: Backend, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not backend.emulated:
        pytest.skip("counts the emulator's logged host synchronisations")
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(3, 8 if impl == "syevj" else 40, torch.float64)
    ad = backend.to_device(a)
    torch.ops.simt.synchronize()
    torch.ops.simt.clear_launch_log()
    vals, vecs, status = backend.ops().batched_eigh_status(ad)
    log = torch.ops.simt.launch_log()
    assert not [e for e in log if e.startswith("sync")], log
    assert _ROUTINES[impl] in {e.split()[0] for e in log}
    assert status.cpu().tolist() == [[0, 0]] * 3
    _check_eigh(a, vals.cpu(), vecs.cpu())


def test_batched_eigh_status_empty(backend: Backend) -> None:
    vals, vecs, status = backend.ops().batched_eigh_status(backend.to_device(torch.empty(0, 4, 4)))
    assert vals.shape == (0, 4) and vecs.shape == (0, 4, 4) and status.shape == (0, 2)


def test_batched_eigh_status_shares_the_argument_check(backend: Backend) -> None:
    with pytest.raises(RuntimeError, match="kaisa batched_eigh: a must hold square matrices"):
        backend.ops().batched_eigh_status(backend.to_device(torch.zeros(2, 3, 4)))


# --------------------------------------------------------------------------- #
# the CPU kernel, the wrapper and the fake kernel
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dims", [(3, 70), (2, 5), (4, 1)])
def test_cpu_batched_eigh_status_matches_the_reference(dims: tuple[int, int]) -> None:
    if not ops.extension_available():
        pytest.skip("kaisa._C did not load")
    b, n = dims
    a = _spd_batch(b, n, torch.float64)
    if n > 1:
        a[0, 1, 0] = a[0, 0, 1] = math.nan
    vals, vecs, status = torch.ops.kaisa.batched_eigh_status(a)
    want_vals, _, want_status = ref.eigh_status(a)
    assert torch.equal(status, want_status)
    ok = [not f for f in _failed(status)]
    assert ok == [n == 1 or i > 0 for i in range(b)]
    torch.testing.assert_close(vals[ok], want_vals[ok], rtol=1e-10, atol=1e-10)
    _check_eigh(a[ok], vals[ok], vecs[ok])


def test_eigh_status_wrapper() -> None:
    a = _spd_batch(2, 6, torch.float64)
    for name in ops.BACKENDS:
        with ops.use_backend(name):
            vals, vecs, status = ops.eigh_status(a)
            assert status.tolist() == [[0, 0], [0, 0]]
            _check_eigh(a, vals, vecs)
            with pytest.raises(TypeError, match="float32 or float64"):
                ops.eigh_status(a.half())
            with pytest.raises(ValueError, match="square"):
                ops.eigh_status(torch.zeros(2, 3, 4))


def test_eigh_status_fake_kernel() -> None:
    if not ops.extension_available():
        pytest.skip("kaisa._C did not load")
    vals, vecs, status = torch.ops.kaisa.batched_eigh_status(torch.empty(3, 5, 5, device="meta"))
    assert vals.shape == (3, 5) and vecs.shape == (3, 5, 5) and status.shape == (3, 2)
    assert status.dtype == torch.int32
