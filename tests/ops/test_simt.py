"""The SIMT emulator itself (tools/simt): what tests/ops/test_cuda_ops.py relies on.

Its own kernels (tools/simt/kernels/selftest.cu) check barrier semantics, that a
missing barrier is visible under one of the two schedules, warp shuffles, atomics,
error detection (divergent barriers, exited lanes, bad launch configurations) and
the stream model (work on a stream nobody waits for stays queued). The emulated
device is checked too: fresh memory is poisoned, host and device tensors do not mix.
"""

from __future__ import annotations

import os

import pytest
import torch

from tools.simt.build import rewrite_launches

pytestmark = [
    pytest.mark.emulator,
    pytest.mark.skipif(
        torch.version.cuda is not None or torch.cuda.is_available(),
        reason="the emulator emulates a CUDA device in torch's CPU build",
    ),
]


@pytest.fixture(scope="module", autouse=True)
def _emulator() -> None:
    from tools.simt import build

    build.load(sanitize=os.environ.get("KAISA_SIMT_SANITIZE", "") == "1")


def dev(t: torch.Tensor) -> torch.Tensor:
    return torch.ops.simt.to_device(t)  # type: ignore[no-any-return]


@pytest.fixture(params=[0, 1])
def schedule(request: pytest.FixtureRequest):
    previous = torch.ops.simt.set_schedule(request.param)
    yield request.param
    torch.ops.simt.set_schedule(previous)


def test_rewrite_launches_keeps_lines_and_finds_the_kernel_name() -> None:
    src = "a<<<g, b>>>(x);\nns::k<T, std::vector<int>><<<grid,\n  256, 0, s>>>(p,\n q);\n"
    out = rewrite_launches(src)
    assert out == (
        'a ^ ::simt::Config("a", g, b) ^ ::simt::args(x);\n'
        'ns::k<T, std::vector<int>> ^ ::simt::Config("k", grid,\n  256, 0, s) ^ '
        "::simt::args(p,\n q);\n"
    )
    assert out.count("\n") == src.count("\n")


def test_barrier_orders_shared_memory(schedule: int) -> None:
    x = torch.arange(256.0)
    out = torch.ops.simt_selftest.reverse(dev(x), True).cpu()
    assert torch.equal(out, x.flip(0))


def test_missing_barrier_reads_poisoned_shared_memory() -> None:
    """Without __syncthreads, the threads that run first read unwritten (NaN) shared memory."""
    x = torch.arange(1.0, 257.0)
    outs = []
    for s in (0, 1):
        previous = torch.ops.simt.set_schedule(s)
        outs.append(torch.ops.simt_selftest.reverse(dev(x), False).cpu())
        torch.ops.simt.set_schedule(previous)
    want = x.flip(0)
    ascending, descending = outs
    # ascending: threads 0..127 read s[255..128] before their writers ran
    assert ascending[:128].isnan().all() and torch.equal(ascending[128:], want[128:])
    assert descending[128:].isnan().all() and torch.equal(descending[:128], want[:128])


def test_warp_shuffles(schedule: int) -> None:
    x = torch.randint(-50, 50, (96,)).double().float()  # exact sums in float32
    total, bcast, down = (t.cpu() for t in torch.ops.simt_selftest.shuffle(dev(x), 3))
    warps = x.view(3, 32)
    assert torch.equal(total, warps.sum(1).repeat_interleave(32))
    assert torch.equal(bcast, warps[:, 0].repeat_interleave(32))
    lane = torch.arange(96) % 32
    src = torch.where(lane + 3 < 32, torch.arange(96) + 3, torch.arange(96))
    assert torch.equal(down, x[src])


def test_atomics(schedule: int) -> None:
    total = dev(torch.zeros(1, dtype=torch.float64))
    count = dev(torch.zeros(1, dtype=torch.int32))
    torch.ops.simt_selftest.atomics(total, count, 5, 96)
    assert total.cpu().item() == sum(range(5 * 96))
    assert count.cpu().item() == 5 * 96


def test_indices_follow_cudas_layout(schedule: int) -> None:
    grid, block = (2, 3, 2), (4, 2, 3)
    blocks, threads = 12, 24
    out = dev(torch.full((blocks * threads,), -1, dtype=torch.int64))
    torch.ops.simt_selftest.indices(out, list(grid), list(block))
    b = torch.arange(blocks).repeat_interleave(threads)
    t = torch.arange(threads).repeat(blocks)
    assert torch.equal(out.cpu(), b * 1000 + t)


def test_divergent_barrier_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="divergent __syncthreads"):
        torch.ops.simt_selftest.divergent(dev(torch.zeros(64)))
        torch.ops.simt.synchronize()


def test_warp_barrier_naming_an_exited_lane_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="lane 1 of warp 0, which does not exist or has exited"):
        torch.ops.simt_selftest.exited_lane(dev(torch.zeros(32)))
        torch.ops.simt.synchronize()


def test_bad_launch_configuration_fails_the_launch_check() -> None:
    with pytest.raises(RuntimeError, match="invalid configuration argument"):
        torch.ops.simt_selftest.reverse(dev(torch.zeros(2048)), True)  # 2048 threads per block


@pytest.mark.parametrize("join", [False, True])
def test_work_on_an_unjoined_stream_stays_queued(join: bool) -> None:
    out = dev(torch.zeros(1000))
    torch.ops.simt_selftest.fill_on_side_stream(out, 7.0, join)
    host = out.cpu()  # waits for the current stream only
    if join:
        assert (host == 7.0).all() and torch.ops.simt.pending() == 0
    else:
        assert (host == 0.0).all() and torch.ops.simt.pending() > 0
    torch.ops.simt.synchronize()
    assert (out.cpu() == 7.0).all() and torch.ops.simt.pending() == 0


def test_fresh_device_memory_is_poisoned() -> None:
    d = dev(torch.arange(6.0))
    assert torch.empty_like(d).cpu().isnan().all()
    assert d.new_empty(3).cpu().isnan().all()


def test_host_and_device_tensors_do_not_mix() -> None:
    d = dev(torch.arange(6.0))
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        d + torch.ones(6)


def test_in_place_ops_return_the_device_tensor() -> None:
    d = dev(torch.arange(6.0))
    assert d.add_(1) is d
    assert torch.equal(d.cpu(), torch.arange(1.0, 7.0))


# cublasComputeType_t / cublasStatus_t values (cuBLAS's)
_COMPUTE_32F, _COMPUTE_64F, _COMPUTE_32F_FAST_TF32 = 68, 70, 77
_SUCCESS, _INVALID_VALUE, _NOT_SUPPORTED = 0, 7, 15


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fake_cublas_gemm_ex_is_column_major(ta: bool, tb: bool, dtype: torch.dtype) -> None:
    """C = alpha op(A) op(B) + beta C, every matrix column-major in a padded leading dimension."""
    m, n, k, pad = 5, 3, 4, 2
    # column-major X (rows x cols) with leading dimension ld: the row-major (cols, ld) buffer
    a_rows, a_cols = (k, m) if ta else (m, k)
    b_rows, b_cols = (n, k) if tb else (k, n)
    a = torch.randn(a_cols, a_rows + pad).to(dtype)
    b = torch.randn(b_cols, b_rows + pad).to(dtype)
    c_type = torch.float64 if dtype == torch.float64 else torch.float32
    c = torch.randn(n, m + pad, dtype=c_type)
    compute = _COMPUTE_64F if dtype == torch.float64 else _COMPUTE_32F
    cd = dev(c)
    status = torch.ops.simt_selftest.gemm_ex(dev(a), dev(b), cd, m, n, k, ta, tb, a_rows + pad,
                                             b_rows + pad, m + pad, 0.5, 2.0, compute)
    assert status == _SUCCESS
    am = a.double()[:, :a_rows].T  # the column-major matrix
    bm = b.double()[:, :b_rows].T
    want = 0.5 * (am.T if ta else am) @ (bm.T if tb else bm) + 2.0 * c.double()[:, :m].T
    got = cd.cpu()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got[:, :m].T.double(), want, rtol=tol, atol=tol)
    assert torch.equal(got[:, m:], c[:, m:]), "wrote outside the leading dimension's rows"


@pytest.mark.parametrize("lda,ldb,ldc", [(4, 4, 5), (5, 3, 5), (5, 4, 4), (0, 4, 5)])
def test_fake_cublas_gemm_ex_rejects_short_leading_dimensions(lda: int, ldb: int, ldc: int) -> None:
    """m = 5, n = 3, k = 4, op N / N: lda >= 5, ldb >= 4, ldc >= 5, as cuBLAS documents."""
    a, b, c = dev(torch.zeros(4, 5)), dev(torch.zeros(3, 5)), dev(torch.zeros(3, 5))
    status = torch.ops.simt_selftest.gemm_ex(a, b, c, 5, 3, 4, False, False, lda, ldb, ldc, 1.0,
                                             0.0, _COMPUTE_32F)
    assert status == _INVALID_VALUE


def test_fake_cublas_gemm_ex_rejects_unlisted_type_combinations() -> None:
    half, single = dev(torch.zeros(4, 4, dtype=torch.float16)), dev(torch.zeros(4, 4))
    args = (4, 4, 4, False, False, 4, 4, 4, 1.0, 0.0)
    # TF32 compute needs fp32 A/B; 16-bit A with an fp32 B is no cuBLAS combination
    assert torch.ops.simt_selftest.gemm_ex(half, half, single, *args, _COMPUTE_32F_FAST_TF32) == (
        _NOT_SUPPORTED)
    assert torch.ops.simt_selftest.gemm_ex(half, single, single, *args, _COMPUTE_32F) == (
        _NOT_SUPPORTED)
    assert torch.ops.simt_selftest.gemm_ex(single, single, single, *args, _COMPUTE_64F) == (
        _NOT_SUPPORTED)
