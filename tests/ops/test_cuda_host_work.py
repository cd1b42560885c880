"""What the CUDA ops' host code costs: host synchronisations, workspaces, size limits.

The emulator (tools/simt) logs every blocking device-to-host read (``sync ...``: a
``.cpu()``, ``.tolist()``, ``.item()``, a stream / event / device synchronisation) and
every fresh device allocation (``alloc dtype=... shape=...``) next to its kernel
launches and library calls, so these tests count them. On a GPU they are skipped
where they need the log.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch

import kaisa.ops as ops
from kaisa.methods import linalg
from kaisa.ops import _reference as ref
from tests.ops.test_cuda_ops import _assert_close_rel, _check_eigh, _rand, _runs, _spd_batch
from tests.support.backends import Backend


def _log(prefix: str) -> list[str]:
    return [e for e in torch.ops.simt.launch_log() if e.startswith(prefix)]


def _routines() -> list[str]:
    names = ("syevjBatched", "XsyevBatched", "syevd")
    return [e.split()[0] for e in torch.ops.simt.launch_log() if e.split()[0] in names]


def _emulated_only(backend: Backend) -> None:
    if not backend.emulated:
        pytest.skip("counts entries of the emulator's log")


# --------------------------------------------------------------------------- #
# batched_eigh: one host synchronisation, and kaisa.methods.linalg adds none
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("impl,n,batch", [("syevj", 8, 3), ("xsyev_batched", 40, 3),
                                          ("syevd", 40, 3), ("syevd", 40, 1)])
def test_batched_eigh_synchronises_once(
    backend: Backend, impl: str, n: int, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _emulated_only(backend)
    monkeypatch.setenv("KAISA_EIGH_IMPL", impl)
    a = _spd_batch(batch, n, torch.float64)
    ad = backend.to_device(a)
    torch.ops.simt.synchronize()
    torch.ops.simt.clear_launch_log()
    vals, vecs = backend.ops().batched_eigh(ad)
    assert len(_log("sync")) == 1, torch.ops.simt.launch_log()
    _check_eigh(a, vals.cpu(), vecs.cpu())


@pytest.fixture
def emulated_ext(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``kaisa.ops`` sends emulated device tensors to the emulated CUDA kernels."""
    _emulated_only(backend)
    monkeypatch.setattr(ops, "_use_ext", lambda op, device: True)
    monkeypatch.setattr(torch.ops.kaisa, "batched_eigh", torch.ops.kaisa_simt.batched_eigh)
    monkeypatch.setattr(torch.ops.kaisa, "batched_eigh_status",
                        torch.ops.kaisa_simt.batched_eigh_status)
    yield


def _round_factors(dtype: torch.dtype) -> list[torch.Tensor]:
    """Four factors in three size groups: n = 40 (two factors, 3 matrices), 8 and 20."""
    return [_spd_batch(2, 40, dtype), _spd_batch(1, 40, dtype), _spd_batch(3, 8, dtype),
            _spd_batch(2, 20, dtype)]


@pytest.mark.usefixtures("emulated_ext")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_eigen_decompositions_synchronise_once_per_round(
    backend: Backend, dtype: torch.dtype
) -> None:
    """Three size groups, one host synchronisation: every group's status is read at once.

    The op's own finiteness check is the only one: kaisa.methods.linalg does not repeat it.
    """
    host = _round_factors(dtype)
    factors = [backend.to_device(f) for f in host]
    torch.ops.simt.synchronize()
    torch.ops.simt.clear_launch_log()
    results = linalg.eigen_decompositions(factors, inv_dtype=dtype)
    assert len(_log("sync")) == 1, _log("sync")
    assert sorted(_routines()) == ["XsyevBatched", "syevjBatched", "syevjBatched"]
    for f, res in zip(host, results, strict=True):
        assert res is not None
        _check_eigh(f, res.eigenvalues.cpu(), res.eigenvectors.cpu())


@pytest.mark.usefixtures("emulated_ext")
@pytest.mark.parametrize("alone_fails", [False, True])
def test_eigen_decompositions_isolate_a_factor_the_solver_fails(
    backend: Backend, alone_fails: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A nonzero info in one group (matrix 2 of the n = 40 batch: factor "b") redoes only b.

    As before the status was deferred: b is decomposed alone in float32 (syevd, one more
    synchronisation); if that fails too, in float64 with the "retried in float64" warning.
    The other factors keep their batched results; every result is a correct decomposition.
    """
    host = _round_factors(torch.float32)
    factors = [backend.to_device(f) for f in host]
    torch.ops.simt.inject_solver_info("XsyevBatched", 2, 3)
    if alone_fails:
        torch.ops.simt.inject_solver_info("syevd", 0, 3)
    torch.ops.simt.synchronize()
    torch.ops.simt.clear_launch_log()
    with caplog.at_level(logging.WARNING, logger="kaisa"):
        results = linalg.eigen_decompositions(factors, inv_dtype=torch.float32,
                                              names=["a", "b", "c", "d"])
    redos = 2 if alone_fails else 1
    assert len(_log("sync")) == 1 + redos, _log("sync")
    assert sorted(_routines()) == sorted(["XsyevBatched", "syevjBatched", "syevjBatched"]
                                         + ["syevd"] * redos)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == (["eigendecomposition of b retried in float64"] if alone_fails else [])
    for f, res in zip(host, results, strict=True):
        assert res is not None and res.eigenvalues.dtype == torch.float32
        _check_eigh(f, res.eigenvalues.cpu(), res.eigenvectors.cpu())


@pytest.mark.usefixtures("emulated_ext")
def test_eigen_decompositions_isolate_a_group_whose_solver_call_is_rejected(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The status op raising (cuSOLVER rejects the batched call) splits the group too.

    The emulator's XsyevBatched takes at most six n = 40 matrices per call while kaisa
    believes in INT32_MAX elements: the group's batch of 7 is rejected, each factor alone
    (4 and 3 matrices) is accepted.
    """
    monkeypatch.setenv("KAISA_EIGH_IMPL", "xsyev_batched")
    host = [_spd_batch(4, 40, torch.float64), _spd_batch(3, 40, torch.float64)]
    factors = [backend.to_device(f) for f in host]
    previous = torch.ops.simt.set_xsyev_max_elements(6 * 40 * 40)
    try:
        results = linalg.eigen_decompositions(factors, inv_dtype=torch.float64)
    finally:
        torch.ops.simt.set_xsyev_max_elements(previous)
    for f, res in zip(host, results, strict=True):
        assert res is not None
        _check_eigh(f, res.eigenvalues.cpu(), res.eigenvectors.cpu())


@pytest.mark.usefixtures("emulated_ext")
def test_eigen_decompositions_still_isolate_a_failing_factor(backend: Backend) -> None:
    """Skipping the Python re-check keeps the fallback: the op raises, the group is split."""
    good = _spd_batch(2, 40, torch.float32)
    bad = _spd_batch(1, 40, torch.float32)
    bad[0, 3, 2] = bad[0, 2, 3] = math.nan
    factors = [backend.to_device(good), backend.to_device(bad)]
    results = linalg.eigen_decompositions(factors, inv_dtype=torch.float32)
    assert results[1] is None
    assert results[0] is not None
    _check_eigh(good, results[0].eigenvalues.cpu(), results[0].eigenvectors.cpu())


def test_only_the_cuda_kernel_promises_finite_eigh_results() -> None:
    """Elsewhere kaisa.methods.linalg checks the results itself."""
    a = _spd_batch(2, 6, torch.float64)
    for name in ops.BACKENDS:
        with ops.use_backend(name):
            assert not ops.eigh_checks_finite(a)
            assert not ops.eigh_checks_finite(a.to(torch.float16))


@pytest.mark.usefixtures("emulated_ext")
def test_the_cuda_kernel_promises_finite_eigh_results(backend: Backend) -> None:
    a = backend.to_device(_spd_batch(2, 6, torch.float64))
    assert ops.eigh_checks_finite(a)


# --------------------------------------------------------------------------- #
# KAISA_SYEVJ_MAX_N: where syevjBatched stops (a performance knee, not an API limit)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("limit,n,routine", [(None, 20, "syevjBatched"),
                                             ("16", 20, "XsyevBatched"),
                                             ("16", 16, "syevjBatched"),
                                             ("0", 5, "XsyevBatched")])
def test_syevj_max_n_is_settable(
    backend: Backend, limit: str | None, n: int, routine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if limit is None:
        monkeypatch.delenv("KAISA_SYEVJ_MAX_N", raising=False)
    else:
        monkeypatch.setenv("KAISA_SYEVJ_MAX_N", limit)
    a = _spd_batch(3, n, torch.float64)
    for vals, vecs in _runs(backend, lambda: backend.ops().batched_eigh(backend.to_device(a))):
        _check_eigh(a, vals, vecs)
    if backend.emulated:
        assert set(_routines()) == {routine}


def test_syevj_max_n_must_be_a_count(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAISA_SYEVJ_MAX_N", "-1")
    with pytest.raises(RuntimeError, match="KAISA_SYEVJ_MAX_N"):
        backend.ops().batched_eigh(backend.to_device(_spd_batch(2, 8, torch.float32)))


# --------------------------------------------------------------------------- #
# covariance: the split-K workspace only when the rows are split
# --------------------------------------------------------------------------- #


def _workspaces() -> list[str]:
    """``empty`` allocations of four dimensions: the [split][group][d][d] partial tiles.

    (Not the ``by aten::...`` copies, e.g. the input's upload inside the timed call.)
    """
    return [e for e in _log("alloc")
            if " by " not in e and e.split("shape=[")[1].count(",") == 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("sms", [1, 132])
def test_covariance_workspace_only_when_split(
    backend: Backend, sms: int, conv: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    _emulated_only(backend)
    monkeypatch.setenv("KAISA_COVARIANCE_IMPL", "fused")  # the fused kernel's workspace
    previous = torch.ops.simt.set_sm_count(sms)
    try:
        if conv:
            x = _rand((2, 16, 30, 30), dtype)  # d = 145: 6 tile pairs
            args = ([3, 3], [1, 1], [1, 1], [1, 1], 1, True, 0.5)
            got = _runs(backend, lambda: backend.ops().conv_covariance(backend.to_device(x),
                                                                       *args))
            expected = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 1, True,
                                           0.5)
        else:
            x = _rand((3000, 200), dtype)  # d = 201: 10 tile pairs
            got = _runs(backend, lambda: backend.ops().covariance(backend.to_device(x), 0.5,
                                                                  True))
            expected = ref.covariance(x.double(), 0.5, bias=True)
        (grid,) = backend.launches("gram_tile_kernel")
        split = grid[2] > 1
        workspaces = _workspaces()
        finalized = backend.launches("finalize_kernel")
    finally:
        torch.ops.simt.set_sm_count(previous)
    assert split == (sms == 132), grid
    if split:
        assert len(workspaces) == 1 and f"shape=[{grid[2]}," in workspaces[0], workspaces
        assert len(finalized) == 1
    else:
        assert workspaces == [] and finalized == [], (workspaces, finalized)
    for out in got:
        assert torch.equal(out, out.mT)
        _assert_close_rel(out, expected, dtype)


# --------------------------------------------------------------------------- #
# eigen_precondition: the documented 32-bit limits, checked for every backend
# --------------------------------------------------------------------------- #


def _huge_operands() -> tuple[torch.Tensor, ...]:
    """A (65536, 32768) gradient, 2^31 elements, as stride-0 views of one element."""
    m, n = 1 << 16, 1 << 15
    one = torch.ones((), dtype=torch.float16)
    return (one.expand(m, n), one.expand(n, n), one.expand(m, m), one.expand(n), one.expand(m))


def test_eigen_precondition_rejects_more_than_2_31_elements_per_matrix(backend: Backend) -> None:
    """The kernel's element index is 32-bit: the shared argument check rejects bigger ones.

    The operands are stride-0 views of one device element, as on the host: the check reads
    shapes only (device copies would be 14 GB, 51 s under the sanitizers)."""
    grad, qa, qg, da, dg = (backend.to_device(t[(0,) * t.dim()].clone()).expand(t.shape)
                            for t in _huge_operands())
    with pytest.raises(RuntimeError, match=r"at most 2\^31 - 1 elements per matrix"):
        backend.ops().eigen_precondition(grad, qa, qg, da, dg, None, 0.1)


def test_eigen_precondition_cpu_kernel_shares_the_limit() -> None:
    if not ops.extension_available():
        pytest.skip("kaisa._C did not load")
    with pytest.raises(RuntimeError, match=r"at most 2\^31 - 1 elements per matrix"):
        torch.ops.kaisa.eigen_precondition(*_huge_operands(), None, 0.1)


def test_eigen_precondition_wrapper_rejects_more_than_2_31_elements_per_matrix() -> None:
    grad, qa, qg, da, dg = (t.to("meta") for t in _huge_operands())
    for name in ops.BACKENDS:
        with ops.use_backend(name), pytest.raises(ValueError, match=r"2\^31 - 1 elements"):
            ops.eigen_precondition(grad, qa, qg, da=da, dg=dg, damping=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sms", [1, 132])
@pytest.mark.parametrize("dims", [(3, 64, 65), (12, 5, 3), (1, 300, 301), (70, 1, 9)])
def test_eigen_precondition_division_grid(
    backend: Backend, dims: tuple[int, int, int], sms: int, dtype: torch.dtype
) -> None:
    """The division kernel's grid (matrices over y, elements over x) at odd shapes.

    One SM (8 blocks) makes every block loop over several matrices' elements.
    """
    b, m, n = dims
    grad = _rand((b, m, n), dtype)
    qa = torch.linalg.qr(torch.randn(b, n, n, dtype=torch.float64))[0].to(dtype)
    qg = torch.linalg.qr(torch.randn(b, m, m, dtype=torch.float64))[0].to(dtype)
    da = torch.rand(b, n).to(dtype)
    dg = torch.rand(b, m).to(dtype)
    expected = ref.eigen_precondition(grad.double(), qa.double(), qg.double(), da.double(),
                                      dg.double(), None, 0.03)
    dev = backend.to_device
    previous = torch.ops.simt.set_sm_count(sms) if backend.emulated else 0
    try:
        runs = _runs(backend, lambda: backend.ops().eigen_precondition(
            dev(grad), dev(qa), dev(qg), dev(da), dev(dg), None, 0.03))
    finally:
        if backend.emulated:
            torch.ops.simt.set_sm_count(previous)
    tol = {torch.float64: 1e-10, torch.float32: 5e-5, torch.bfloat16: 5e-2,
           torch.float16: 1e-2}[dtype]
    scale = max(expected.abs().max().item(), 1e-30)
    for out in runs:
        assert out.shape == grad.shape and out.dtype == dtype
        assert (out.double() - expected).abs().max().item() <= tol * scale


@pytest.mark.parametrize("use_dgda", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eigen_precondition_makes_no_fp32_copies_of_16_bit_bases(
    backend: Backend, dtype: torch.dtype, use_dgda: bool
) -> None:
    """16-bit QA / QG (and the gradient) are read as they are: no fp32 copy per call.

    A cache of converted copies keyed on the tensor's version counter would be unsafe
    (collectives write without bumping it), so the products read 16-bit operands and
    accumulate in fp32; the only fp32 buffers are the two (b, m, n) intermediates (and
    the small fp32 eigenvalue vectors or the (b, m, n) reciprocal).
    """
    _emulated_only(backend)
    b, m, n = 2, 24, 40
    grad = _rand((b, m, n), dtype)
    qa = torch.linalg.qr(torch.randn(b, n, n, dtype=torch.float64))[0].to(dtype)
    qg = torch.linalg.qr(torch.randn(b, m, m, dtype=torch.float64))[0].to(dtype)
    da = torch.rand(b, n).to(dtype)
    dg = torch.rand(b, m).to(dtype)
    dgda = (1.0 / (dg.double().unsqueeze(-1) * da.double().unsqueeze(-2) + 0.03)).to(dtype)
    args = [backend.to_device(t) for t in (grad, qa, qg)]
    factors = [None, None, backend.to_device(dgda)] if use_dgda else [
        backend.to_device(da), backend.to_device(dg), None]
    torch.ops.simt.synchronize()
    torch.ops.simt.clear_launch_log()
    out = backend.ops().eigen_precondition(*args, *factors, 0.03)
    allocs = _log("alloc")
    fp32 = [e for e in allocs if e.startswith("alloc dtype=Float ")]
    assert not [e for e in fp32 if f"[{b}, {n}, {n}]" in e or f"[{b}, {m}, {m}]" in e], allocs
    assert len([e for e in fp32 if f"[{b}, {m}, {n}]" in e]) == 2 + use_dgda, allocs
    expected = ref.eigen_precondition(grad.double(), qa.double(), qg.double(),
                                      None if use_dgda else da.double(),
                                      None if use_dgda else dg.double(),
                                      dgda.double() if use_dgda else None, 0.03)
    _assert_close_rel(out.cpu(), expected, dtype)
