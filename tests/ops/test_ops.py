"""Tests of kaisa.ops: reference exactness, extension vs reference, API behaviour."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from kaisa.ops._checks import ConvArgs
from tests.support.cases import CONV_OP_CASES

HAS_EXT = ops.extension_available()
needs_ext = pytest.mark.skipif(
    not HAS_EXT, reason=f"kaisa._C extension not available: {ops.extension_error()}"
)

CONV_CASES = CONV_OP_CASES


@pytest.fixture
def ext_backend() -> Iterator[None]:
    if not HAS_EXT:
        pytest.skip(f"kaisa._C extension not available: {ops.extension_error()}")
    with ops.use_backend("ext"):
        yield


@pytest.fixture(params=["torch", pytest.param("ext", marks=needs_ext)])
def any_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name = str(request.param)
    with ops.use_backend(name):
        yield name


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float64:
        return {"rtol": 1e-10, "atol": 1e-10}
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    return {"rtol": 2e-2, "atol": 2e-2}


def _explicit_patches(
    x: torch.Tensor,
    k: tuple[int, int],
    s: tuple[int, int],
    p: tuple[int, int],
    d: tuple[int, int],
    groups: int,
    bias: bool,
) -> torch.Tensor:
    """Patch matrices built with explicit loops (no unfold)."""
    n, c, h, w = x.shape
    oh = (h + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (w + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    cg = c // groups
    out = torch.zeros(groups, n * oh * ow, cg * k[0] * k[1] + int(bias), dtype=x.dtype)
    for g in range(groups):
        for row, (b, i, j) in enumerate(itertools.product(range(n), range(oh), range(ow))):
            col = 0
            for ch in range(g * cg, (g + 1) * cg):
                for ki in range(k[0]):
                    for kj in range(k[1]):
                        ih = i * s[0] - p[0] + ki * d[0]
                        iw = j * s[1] - p[1] + kj * d[1]
                        if 0 <= ih < h and 0 <= iw < w:
                            out[g, row, col] = x[b, ch, ih, iw]
                        col += 1
            if bias:
                out[g, row, col] = 1.0
    return out


# --------------------------------------------------------------------------- #
# Reference exactness (float64)
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bias", [False, True])
def test_reference_covariance_exact(bias: bool) -> None:
    x = torch.randn(37, 9, dtype=torch.float64)
    xb = torch.cat([x, torch.ones(37, 1, dtype=torch.float64)], 1) if bias else x
    expected = 0.25 * torch.einsum("ri,rj->ij", xb, xb)
    got = ref.covariance(x, 0.25, bias=bias)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, got.T)


@pytest.mark.parametrize(
    "case",
    [
        ((2, 4, 5, 6), (3, 3), (1, 1), (1, 1), (1, 1), 2),
        ((1, 3, 7, 5), (2, 3), (2, 1), (0, 1), (1, 2), 1),
        ((2, 3, 4, 4), (1, 1), (1, 1), (0, 0), (1, 1), 3),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_conv_patches_match_explicit_loops(case: Any, bias: bool) -> None:
    shape, k, s, p, d, g = case
    x = torch.randn(*shape, dtype=torch.float64)
    expected = _explicit_patches(x, k, s, p, d, g, bias)
    got = ref.conv_patches(x, ConvArgs(k, s, p, d, g), bias)
    assert torch.equal(got, expected)
    cov = ref.conv_covariance(x, k, s, p, d, g, bias, 0.5)
    torch.testing.assert_close(
        cov, 0.5 * expected.transpose(1, 2) @ expected, rtol=1e-12, atol=1e-12
    )
    assert torch.equal(cov, cov.transpose(1, 2))


def test_reference_conv_patches_column_order_matches_weight_view() -> None:
    # conv2d(x, W) == P @ W.view(out, -1)^T for every group.
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    w = torch.randn(6, 2, 3, 2, dtype=torch.float64)
    y = F.conv2d(x, w, stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2)
    p = ref.conv_patches(x, ConvArgs((3, 2), (2, 1), (1, 1), (1, 2), 2), False)
    for g in range(2):
        wg = w[3 * g : 3 * (g + 1)].reshape(3, -1)
        yg = y[:, 3 * g : 3 * (g + 1)].permute(0, 2, 3, 1).reshape(-1, 3)
        torch.testing.assert_close(p[g] @ wg.T, yg)


def _kron_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor,
    qg: torch.Tensor,
    da: torch.Tensor,
    dg: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    a = qa @ torch.diag(da) @ qa.T
    g = qg @ torch.diag(dg) @ qg.T
    m, n = grad.shape
    mat = torch.kron(g, a) + damping * torch.eye(m * n, dtype=grad.dtype)
    return torch.linalg.solve(mat, grad.reshape(-1)).reshape(m, n)


def _random_eig(n: int, batch: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    q, _ = torch.linalg.qr(torch.randn(*batch, n, n, dtype=torch.float64))
    d = torch.rand(*batch, n, dtype=torch.float64) + 0.1
    return q, d


def test_reference_eigen_precondition_matches_kron_inverse() -> None:
    m, n, damping = 5, 7, 0.03
    grad = torch.randn(m, n, dtype=torch.float64)
    qa, da = _random_eig(n)
    qg, dg = _random_eig(m)
    expected = _kron_precondition(grad, qa, qg, da, dg, damping)
    got = ref.eigen_precondition(grad, qa, qg, da, dg, None, damping)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    dgda = 1.0 / (dg[:, None] * da[None, :] + damping)
    got2 = ref.eigen_precondition(grad, qa, qg, None, None, dgda, 0.0)
    torch.testing.assert_close(got2, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- #
# Both backends against explicit math
# --------------------------------------------------------------------------- #


def test_eigen_precondition_kron_both_backends(any_backend: str) -> None:
    b, m, n, damping = 3, 4, 6, 0.1
    grad = torch.randn(b, m, n, dtype=torch.float64)
    qa, da = _random_eig(n, (b,))
    qg, dg = _random_eig(m, (b,))
    got = ops.eigen_precondition(grad, qa, qg, da=da, dg=dg, damping=damping)
    for i in range(b):
        expected = _kron_precondition(grad[i], qa[i], qg[i], da[i], dg[i], damping)
        torch.testing.assert_close(got[i], expected, rtol=1e-10, atol=1e-10)
    dgda = 1.0 / (dg[:, :, None] * da[:, None, :] + damping)
    got2 = ops.eigen_precondition(grad, qa, qg, dgda=dgda)
    torch.testing.assert_close(got2, got, rtol=1e-10, atol=1e-10)
    # unbatched
    got3 = ops.eigen_precondition(grad[1], qa[1], qg[1], da=da[1], dg=dg[1], damping=damping)
    torch.testing.assert_close(got3, got[1], rtol=1e-10, atol=1e-10)


def test_eigh_both_backends(any_backend: str) -> None:
    a = torch.randn(3, 6, 6, dtype=torch.float64)
    a = a @ a.transpose(1, 2)
    vals, vecs = ops.eigh(a)
    assert vals.shape == (3, 6) and vecs.shape == (3, 6, 6)
    assert bool((vals[:, 1:] >= vals[:, :-1]).all())
    torch.testing.assert_close(vecs @ torch.diag_embed(vals) @ vecs.transpose(1, 2), a)
    vals2, _ = ops.eigh(a[0])
    torch.testing.assert_close(vals2, torch.linalg.eigvalsh(a[0]))


@pytest.mark.parametrize("case", CONV_CASES[:4])
def test_conv_covariance_both_backends_exact_float64(any_backend: str, case: Any) -> None:
    shape, k, s, p, d, g = case
    x = torch.randn(*shape, dtype=torch.float64)
    pats = _explicit_patches(x, k, s, p, d, g, True)
    got = ops.conv_covariance(x, k, s, p, d, g, True, 0.125)
    torch.testing.assert_close(got, 0.125 * pats.transpose(1, 2) @ pats, rtol=1e-10, atol=1e-10)
    assert torch.equal(got, got.transpose(1, 2))


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_channel_covariance_exact_float64_as_the_gpu_computes_it(
    any_backend: str, groups: int, layout: str
) -> None:
    """A conv's G factors: the CPU's path and the 1x1 ``conv_covariance`` a GPU takes."""
    x = torch.randn(3, 6, 5, 7, dtype=torch.float64)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = torch.randn(3, 12, 5, 7, dtype=torch.float64)[:, ::2]
    d = x.permute(0, 2, 3, 1).reshape(-1, 6).reshape(-1, groups, 6 // groups).transpose(0, 1)
    expected = 0.25 * d.transpose(1, 2) @ d
    got = ops.channel_covariance(x, groups, 0.25)
    gpu = ops.conv_covariance(x, (1, 1), (1, 1), (0, 0), (1, 1), groups, False, 0.25)
    for out in (got, gpu):
        assert out.shape == (groups, 6 // groups, 6 // groups)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(out, out.transpose(1, 2))
    with pytest.raises(ValueError, match="groups"):
        ops.channel_covariance(x, 4, 0.25)


# --------------------------------------------------------------------------- #
# Extension vs reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("shape", [(1, 1), (57, 13), (300, 131), (2000, 200)])
def test_covariance_ext_matches_reference(
    ext_backend: None, dtype: torch.dtype, bias: bool, layout: str, shape: tuple[int, int]
) -> None:
    rows, d = shape
    if layout == "contiguous":
        x = torch.randn(rows, d, dtype=dtype)
    elif layout == "transposed":
        x = torch.randn(d, rows, dtype=dtype).T
    else:
        x = torch.randn(2 * rows, 3 * d, dtype=dtype)[::2, ::3]
    before = x.clone()
    got = ops.covariance(x, 1.0 / rows, bias=bias)
    expected = ref.covariance(x, 1.0 / rows, bias=bias)
    assert got.dtype == dtype and got.shape == (d + bias, d + bias) and got.is_contiguous()
    torch.testing.assert_close(got, expected, **_tol(dtype))
    assert torch.equal(got, got.T)
    assert torch.equal(x, before)


def test_empty_inputs(any_backend: str) -> None:
    got = ops.covariance(torch.randn(0, 4), 1.0, bias=True)
    assert torch.equal(got, torch.zeros(5, 5))
    x = torch.randn(0, 4, 5, 5)
    got = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 1.0)
    assert torch.equal(got, torch.zeros(2, 19, 19))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_covariance_ext_low_precision(ext_backend: None, dtype: torch.dtype) -> None:
    x = torch.randn(300, 40).to(dtype)
    got = ops.covariance(x, 1 / 300, bias=True)
    assert got.dtype == dtype
    expected = ref.covariance(x.double(), 1 / 300, bias=True)
    torch.testing.assert_close(got.double(), expected, **_tol(dtype))
    assert torch.equal(got, got.T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_covariance_ext_matches_reference(
    ext_backend: None, dtype: torch.dtype, bias: bool, case: Any
) -> None:
    shape, k, s, p, d, g = case
    x = torch.randn(*shape, dtype=dtype)
    before = x.clone()
    got = ops.conv_covariance(x, k, s, p, d, g, bias, 0.5)
    expected = ref.conv_covariance(x, k, s, p, d, g, bias, 0.5)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, expected, **_tol(dtype))
    assert torch.equal(got, got.transpose(1, 2))
    assert torch.equal(x, before)


@pytest.mark.parametrize("layout", ["channels_last", "sliced", "transposed_hw"])
@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[3], CONV_CASES[6]])
def test_conv_covariance_ext_non_contiguous(ext_backend: None, layout: str, case: Any) -> None:
    shape, k, s, p, d, g = case
    n, c, h, w = shape
    if layout == "channels_last":
        x = torch.randn(*shape).contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.randn(n, 2 * c, h + 3, w + 1)[:, ::2, 1 : h + 1, :w]
    else:
        x = torch.randn(n, c, w, h).transpose(2, 3)
    got = ops.conv_covariance(x, k, s, p, d, g, True, 1.0)
    expected = ref.conv_covariance(x.contiguous(), k, s, p, d, g, True, 1.0)
    torch.testing.assert_close(got, expected, **_tol(torch.float32))


@pytest.mark.parametrize("case", CONV_CASES)
def test_compiled_conv_kernel_matches_reference(ext_backend: None, case: Any) -> None:
    # The CPU kernel itself: the wrapper sends stride-1 cases to kaisa.ops._shifted.
    shape, k, s, p, d, g = case
    x = torch.randn(*shape, dtype=torch.float64)
    got = torch.ops.kaisa.conv_covariance(x, list(k), list(s), list(p), list(d), g, True, 0.5)
    torch.testing.assert_close(got, ref.conv_covariance(x, k, s, p, d, g, True, 0.5),
                               **_tol(torch.float64))
    assert torch.equal(got, got.transpose(1, 2))


def test_conv_covariance_ext_multi_tile(ext_backend: None) -> None:
    # Large enough for several im2col tiles (and worker accumulators): the kernel itself.
    x = torch.randn(24, 16, 40, 40, dtype=torch.float64)

    def kernel() -> torch.Tensor:
        out: torch.Tensor = torch.ops.kaisa.conv_covariance(
            x, [3, 3], [1, 1], [1, 1], [1, 1], 1, True, 1e-3)
        return out

    got = kernel()
    expected = ref.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 1e-3)
    torch.testing.assert_close(got, expected, **_tol(torch.float64))
    torch.testing.assert_close(ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True,
                                                   1e-3), expected, **_tol(torch.float64))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got1 = kernel()
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got1, expected, **_tol(torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_conv_covariance_ext_low_precision(ext_backend: None, dtype: torch.dtype) -> None:
    x = torch.randn(2, 4, 8, 8).to(dtype)
    got = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 1 / 128)
    expected = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 1 / 128)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), expected, **_tol(dtype))


# --------------------------------------------------------------------------- #
# Running averages
# --------------------------------------------------------------------------- #


def _sym(n: int, batch: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    a = torch.randn(*batch, n, n, dtype=dtype)
    return a + a.transpose(-1, -2)


# --------------------------------------------------------------------------- #
# eigen_precondition / eigh: extension vs reference
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("mode", ["dadg", "dgda"])
def test_eigen_precondition_ext_matches_reference(
    ext_backend: None, dtype: torch.dtype, batched: bool, mode: str
) -> None:
    b = (2,) if batched else ()
    m, n = 17, 29
    grad = torch.randn(*b, m, n, dtype=dtype)
    qa, da = (t.to(dtype) for t in _random_eig(n, b))
    qg, dg = (t.to(dtype) for t in _random_eig(m, b))
    inputs = [grad, qa, qg, da, dg]
    before = [t.clone() for t in inputs]
    if mode == "dadg":
        got = ops.eigen_precondition(grad, qa, qg, da=da, dg=dg, damping=0.01)
        expected = ref.eigen_precondition(grad, qa, qg, da, dg, None, 0.01)
    else:
        dgda = 1.0 / (dg.unsqueeze(-1) * da.unsqueeze(-2) + 0.01)
        got = ops.eigen_precondition(
            grad, qa.transpose(-1, -2).contiguous().transpose(-1, -2), qg, dgda=dgda
        )
        expected = ref.eigen_precondition(grad, qa, qg, None, None, dgda, 0.0)
    assert got.shape == grad.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **_tol(dtype))
    for t, t0 in zip(inputs, before, strict=True):
        assert torch.equal(t, t0)


def test_eigh_ext_matches_torch(ext_backend: None) -> None:
    a = torch.randn(4, 20, 20)
    a = a + a.transpose(1, 2)
    a0 = a.clone()
    vals, vecs = ops.eigh(a)
    evals, _ = torch.linalg.eigh(a)
    torch.testing.assert_close(vals, evals, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        vecs @ torch.diag_embed(vals) @ vecs.transpose(1, 2), a, rtol=1e-4, atol=1e-4
    )
    assert vecs.is_contiguous() and vals.is_contiguous()
    assert torch.equal(a, a0)


# --------------------------------------------------------------------------- #
# Validation
# --------------------------------------------------------------------------- #

_CONV_OK: dict[str, Any] = {
    "kernel_size": (3, 3),
    "stride": (1, 1),
    "padding": (1, 1),
    "dilation": (1, 1),
    "groups": 1,
    "bias": False,
    "scale": 1.0,
}


@pytest.mark.parametrize(
    ("x", "overrides", "exc", "match"),
    [
        (torch.randn(2, 4, 5), {}, ValueError, "x must be 4-D"),
        (torch.ones(1, 4, 5, 5, dtype=torch.int64), {}, TypeError, "floating point"),
        (torch.randn(1, 4, 5, 5), {"groups": 3}, ValueError, "groups=3 must divide"),
        (torch.randn(1, 4, 5, 5), {"kernel_size": (0, 3)}, ValueError, "kernel_size"),
        (torch.randn(1, 4, 5, 5), {"stride": (1,)}, ValueError, "stride"),
        (torch.randn(1, 4, 5, 5), {"padding": (-1, 0)}, ValueError, "padding"),
        (torch.randn(1, 4, 2, 2), {"padding": (0, 0)}, ValueError, "kernel extent"),
    ],
)
def test_conv_covariance_bad_inputs(
    any_backend: str, x: torch.Tensor, overrides: dict[str, Any], exc: type, match: str
) -> None:
    before = x.clone()
    with pytest.raises(exc, match=match):
        ops.conv_covariance(x, **{**_CONV_OK, **overrides})
    assert torch.equal(x, before)


def test_covariance_bad_inputs(any_backend: str) -> None:
    with pytest.raises(ValueError, match="x must be 2-D"):
        ops.covariance(torch.randn(3), 1.0)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        ops.covariance([[1.0]], 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scale"):
        ops.covariance(torch.randn(3, 2), "1")  # type: ignore[arg-type]


def test_eigen_precondition_bad_inputs(any_backend: str) -> None:
    grad = torch.randn(3, 4)
    qa, da = torch.eye(4), torch.ones(4)
    qg, dg = torch.eye(3), torch.ones(3)
    dgda = torch.ones(3, 4)
    inputs = [grad, qa, qg, da, dg, dgda]
    before = [t.clone() for t in inputs]
    with pytest.raises(ValueError, match="one of"):
        ops.eigen_precondition(grad, qa, qg)
    with pytest.raises(ValueError, match="not both"):
        ops.eigen_precondition(grad, qa, qg, da=da, dg=dg, dgda=dgda)
    with pytest.raises(ValueError, match="together"):
        ops.eigen_precondition(grad, qa, qg, da=da)
    with pytest.raises(ValueError, match="qa must have shape"):
        ops.eigen_precondition(grad, qg, qg, da=da, dg=dg)
    with pytest.raises(ValueError, match="qg must have shape"):
        ops.eigen_precondition(grad, qa, qa, da=da, dg=dg)
    with pytest.raises(ValueError, match="da must have shape"):
        ops.eigen_precondition(grad, qa, qg, da=dg, dg=dg)
    with pytest.raises(ValueError, match="dgda must have the shape"):
        ops.eigen_precondition(grad, qa, qg, dgda=dgda.T)
    with pytest.raises(ValueError, match="dtype"):
        ops.eigen_precondition(grad, qa.double(), qg, da=da, dg=dg)
    with pytest.raises(ValueError, match="grad must be 2 or 3-D"):
        ops.eigen_precondition(grad[0], qa, qg, da=da, dg=dg)
    with pytest.raises(ValueError, match="a must hold square"):
        ops.eigh(torch.randn(2, 3, 4))
    for t, t0 in zip(inputs, before, strict=True):
        assert torch.equal(t, t0)


@needs_ext
def test_kernels_raise_clear_errors_when_called_directly() -> None:
    k = torch.ops.kaisa
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        k.covariance(torch.randn(3), 1.0, False)
    with pytest.raises(RuntimeError, match="groups"):
        k.conv_covariance(torch.randn(1, 4, 5, 5), [3, 3], [1, 1], [1, 1], [1, 1], 3, False, 1.0)
    with pytest.raises(RuntimeError, match="float32, float64, float16 or bfloat16"):
        k.covariance(torch.ones(3, 2, dtype=torch.int32), 1.0, False)
    with pytest.raises(RuntimeError, match="qa must have shape"):  # no shared unbatched qa
        k.eigen_precondition(
            torch.randn(2, 3, 4), torch.eye(4), torch.eye(3).expand(2, 3, 3), None, None,
            torch.ones(2, 3, 4), 0.0,
        )
    with pytest.raises(RuntimeError, match="a must be float32 or float64"):
        k.batched_eigh(torch.eye(3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="one of"):
        k.eigen_precondition(torch.randn(3, 4), torch.eye(4), torch.eye(3), None, None, None, 0.0)
    with pytest.raises(RuntimeError, match="dtype"):
        k.eigen_precondition(
            torch.randn(3, 4),
            torch.eye(4).double(),
            torch.eye(3),
            None,
            None,
            torch.ones(3, 4),
            0.0,
        )
    with pytest.raises(RuntimeError, match="square"):
        k.batched_eigh(torch.randn(2, 3))


# --------------------------------------------------------------------------- #
# torch.library integration
# --------------------------------------------------------------------------- #


def _opcheck_cases() -> list[tuple[str, tuple[Any, ...]]]:
    x2 = torch.randn(20, 6)
    x4 = torch.randn(2, 4, 6, 5)
    grad = torch.randn(2, 3, 4)
    da, qa = torch.linalg.eigh(torch.eye(4).repeat(2, 1, 1) * 2)
    dg, qg = torch.linalg.eigh(torch.eye(3).repeat(2, 1, 1) * 3)
    a = torch.randn(3, 5, 5)
    return [
        ("covariance", (x2, 0.5, True)),
        ("conv_covariance", (x4, [3, 3], [2, 1], [1, 1], [1, 1], 2, True, 0.5)),
        ("eigen_precondition", (grad, qa, qg, da, dg, None, 0.1)),
        ("eigen_precondition", (grad, qa, qg, None, None, torch.rand(2, 3, 4), 0.0)),
        ("batched_eigh", (a + a.transpose(1, 2),)),
        ("batched_eigh", (_sym(70, (3,), torch.float64),)),  # matrix-parallel CPU path
        ("batched_eigh_status", (a + a.transpose(1, 2),)),
        ("batched_eigh_status", (_sym(7, (), torch.float64),)),  # unbatched
    ]


@needs_ext
@pytest.mark.parametrize(("name", "args"), _opcheck_cases(), ids=lambda v: str(v)[:24])
def test_opcheck(name: str, args: tuple[Any, ...]) -> None:
    op = getattr(torch.ops.kaisa, name).default
    torch.library.opcheck(op, args)


@needs_ext
def test_torch_compile_fullgraph(ext_backend: None) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        factor = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 0.1)
        factor = factor + torch.eye(28)
        vals, vecs = ops.eigh(factor)
        return ops.eigen_precondition(
            torch.ones(1, 28, 28), vecs, vecs, da=vals, dg=vals, damping=0.1
        )

    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), step(x), rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- #
# Backend selection
# --------------------------------------------------------------------------- #


def test_set_backend_and_context_manager() -> None:
    original = ops.backend()
    with pytest.raises(ValueError, match="unknown backend"):
        ops.set_backend("cuda")
    with ops.use_backend("torch"):
        assert ops.backend() == "torch"
    assert ops.backend() == original
    with pytest.raises(RuntimeError, match="boom"), ops.use_backend("torch"):
        raise RuntimeError("boom")
    assert ops.backend() == original


def test_set_backend_ext_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops._backend, "_EXT_ERROR", "ImportError: simulated")
    assert not ops.extension_available()
    assert ops.extension_error() == "ImportError: simulated"
    with pytest.raises(RuntimeError, match="simulated"):
        ops.set_backend("ext")


def test_meta_tensors(any_backend: str) -> None:
    x = torch.randn(2, 4, 6, 5, device="meta")
    out = ops.conv_covariance(x, (3, 3), (2, 1), (1, 1), (1, 1), 2, True, 1.0)
    assert out.shape == (2, 19, 19) and out.device.type == "meta"
    vals, vecs = ops.eigh(torch.empty(3, 5, 5, device="meta"))
    assert vals.shape == (3, 5) and vecs.shape == (3, 5, 5)


def test_ext_without_device_kernel_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops._backend, "_BACKEND", "ext")
    monkeypatch.setattr(ops._backend, "_DEVICE_KEYS", {})
    monkeypatch.setattr(ops._backend, "_WARNED_NO_KERNEL", set())
    x = torch.randn(10, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no cpu kernel for covariance"):
        got = ops.covariance(x, 1.0)
    torch.testing.assert_close(got, ref.covariance(x, 1.0))


def test_backends_agree() -> None:
    x = torch.randn(100, 12, dtype=torch.float64)
    with ops.use_backend("torch"):
        a = ops.covariance(x, 0.1, bias=True)
    if HAS_EXT:
        with ops.use_backend("ext"):
            b = ops.covariance(x, 0.1, bias=True)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


_BLOCK_EXT = "import sys; sys.modules['kaisa._C'] = None\n"


def _run_import(env_value: str | None, block_ext: bool) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import kaisa.ops as ops
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                and "kaisa._C" in str(w.message)]
        print("BACKEND", ops.backend(), "WARNINGS", len(msgs))
        for m in msgs:
            print("MSG", m)
        """
    )
    env = dict(os.environ)
    env.pop("KAISA_BACKEND", None)
    if env_value is not None:
        env["KAISA_BACKEND"] = env_value
    prefix = _BLOCK_EXT if block_ext else ""
    return subprocess.run(
        [sys.executable, "-c", prefix + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_env_torch_forces_reference() -> None:
    res = _run_import("torch", block_ext=False)
    assert res.returncode == 0, res.stderr
    assert "BACKEND torch WARNINGS 0" in res.stdout


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_env_invalid_value() -> None:
    res = _run_import("gpu", block_ext=False)
    assert res.returncode != 0
    assert "ValueError" in res.stderr and "KAISA_BACKEND" in res.stderr


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_env_ext_without_extension_raises() -> None:
    res = _run_import("ext", block_ext=True)
    assert res.returncode != 0
    assert "ImportError" in res.stderr and "kaisa._C" in res.stderr


@pytest.mark.slow  # subprocesses / long: the full suite runs it
def test_fallback_warns_once_without_extension() -> None:
    res = _run_import(None, block_ext=True)
    assert res.returncode == 0, res.stderr
    assert "BACKEND torch WARNINGS 1" in res.stdout
    assert "falling back" in res.stdout


@pytest.mark.slow  # subprocesses / long: the full suite runs it
@needs_ext
def test_default_uses_extension_when_available() -> None:
    res = _run_import(None, block_ext=False)
    assert res.returncode == 0, res.stderr
    assert "BACKEND ext WARNINGS 0" in res.stdout
    res = _run_import("ext", block_ext=False)
    assert res.returncode == 0, res.stderr
    assert "BACKEND ext WARNINGS 0" in res.stdout


# --------------------------------------------------------------------------- #
# One op contract: registered schemas, kernels per dispatch key, CPU eigh
# --------------------------------------------------------------------------- #

SCHEMAS_MD = os.path.join(os.path.dirname(__file__), "..", "..", "csrc", "SCHEMAS.md")


def _documented_schemas() -> list[str]:
    with open(SCHEMAS_MD, encoding="utf-8") as f:
        text = f.read()
    block = text.split("```\n", 2)[1]  # the first fenced block lists the schemas
    return [line for line in block.splitlines() if line.strip()]


@needs_ext
def test_registered_ops_are_the_wrappers_and_the_documented_schemas() -> None:
    registered = sorted(
        n.removeprefix("kaisa::") for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("kaisa::")
    )
    assert registered == sorted(ops.OPS)
    actual = [str(getattr(torch.ops.kaisa, op).default._schema) for op in ops.OPS]
    assert _documented_schemas() == actual, "csrc/SCHEMAS.md is out of date"


@needs_ext
def test_every_op_has_cpu_and_meta_kernels() -> None:
    built_with_cuda = any("CUDA" in ops.kernels(op) for op in ops.OPS)
    want = ("CPU", "CUDA", "Meta") if built_with_cuda else ("CPU", "Meta")
    for op in ops.OPS:
        assert ops.kernels(op) == want, op
    if not built_with_cuda:
        assert "no CUDA kernel" in str(ops.cuda_kernels_error())


@needs_ext
def test_fakes_check_their_inputs() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 3, 4)
        with pytest.raises(RuntimeError, match="x must be 2-D"):
            torch.ops.kaisa.covariance(x, 1.0, False)
        out = torch.ops.kaisa.conv_covariance(
            torch.empty(2, 4, 6, 6), [3, 3], [1, 1], [1, 1], [1, 1], 2, True, 1.0
        )
        assert out.shape == (2, 19, 19)
        with pytest.raises(RuntimeError, match="square"):
            torch.ops.kaisa.batched_eigh(torch.empty(2, 3, 4))


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("batch", "n"), [(1, 70), (3, 7), (3, 64), (5, 97), (2, 130)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_batched_eigh_matches_linalg(
    dtype: torch.dtype, batch: int, n: int, threads: int
) -> None:
    """The matrix-parallel CPU kernel equals torch.linalg.eigh (and reads the lower triangle)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = _sym(n, (batch,), torch.float64)
        junk = a + torch.triu(torch.randn_like(a), diagonal=1)  # only the lower triangle counts
        vals, vecs = torch.ops.kaisa.batched_eigh(junk.to(dtype))
    finally:
        torch.set_num_threads(previous)
    want = torch.linalg.eigvalsh(junk)
    tol = 1e-9 if dtype == torch.float64 else 1e-3
    assert vals.is_contiguous() and vecs.is_contiguous()
    torch.testing.assert_close(vals.double(), want, rtol=tol, atol=tol * n)
    recon = vecs.double() @ torch.diag_embed(vals.double()) @ vecs.double().mT
    torch.testing.assert_close(recon, a, rtol=tol, atol=tol * n)


@needs_ext
def test_cpu_batched_eigh_nan_matrix_stays_local() -> None:
    """A NaN matrix gives NaN eigenvalues for that matrix only (the ladder retries it)."""
    a = _sym(80, (3,), torch.float64)
    a[1, 3, 2] = float("nan")
    vals, _ = torch.ops.kaisa.batched_eigh(a)
    assert torch.isfinite(vals).all(-1).tolist() == [True, False, True]
