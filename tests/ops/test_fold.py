"""``kaisa.ops.fold``: one micro-batch factor folded into a running factor.

The CPU kernel equals the reference bit for bit (each product and the sum rounded on its
own) on every branch: the round's first fold (scaled by ``decay``), a later one (not
scaled), a non-finite batch (NaN, +inf, -inf: skipped and counted), odd, empty and
non-contiguous shapes; the wrapper and the kernel reject bad arguments with clear errors
and modify nothing. The CUDA kernels: ``tests/ops/test_cuda_ops.py`` (under the emulator).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref

HAS_EXT = ops.extension_available()
needs_ext = pytest.mark.skipif(not HAS_EXT, reason=f"no kaisa._C: {ops.extension_error()}")

SHAPES = [(1, 1, 1), (3, 7, 7), (2, 33), (1, 300, 300), (0, 4, 4), (5,)]


def _case(shape: tuple[int, ...], dtype: torch.dtype, *, bad: float | None = None,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    running = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    batch = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if bad is not None and batch.numel():
        batch.view(-1)[batch.numel() // 2] = bad
    return running, batch


def _counts(stamp: int, skipped: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(stamp), torch.tensor(skipped)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("stamp", "bad"), [
    (-1, None), (4, None), (-1, math.nan), (4, math.inf), (-1, -math.inf),
], ids=["first", "later", "nan", "inf", "-inf"])
def test_cpu_kernel_equals_the_reference_bit_for_bit(
    dtype: torch.dtype, shape: tuple[int, ...], stamp: int, bad: float | None,
) -> None:
    running, batch = _case(shape, dtype, bad=bad)
    st, sk = _counts(stamp, 2)
    before = [t.clone() for t in (running, batch, st, sk)]
    got = torch.ops.kaisa.fold(running, batch, st, sk, 4, 0.95, 0.05 / 3)
    want = ref.fold(running, batch, st, sk, 4, 0.95, 0.05 / 3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w) and g.dtype == w.dtype and g.is_contiguous()
    folded = bad is None or batch.numel() == 0
    assert int(got[1]) == (4 if folded else stamp)
    assert int(got[2]) == (2 if folded else 3)
    if not folded:
        assert torch.equal(got[0], running)
    for t, t0 in zip((running, batch, st, sk), before, strict=True):  # inputs untouched
        torch.testing.assert_close(t, t0, rtol=0, atol=0, equal_nan=True)


def test_reference_is_the_rule() -> None:
    """``running * rho + batch * w`` with the round's first fold, ``+ batch * w`` after."""
    running, batch = _case((4, 4), torch.float64)
    first = ref.fold(running, batch, *_counts(-1, 0), 0, 0.9, 0.25)
    assert torch.equal(first[0], running * 0.9 + batch * 0.25)
    later = ref.fold(first[0], batch, first[1], first[2], 0, 0.9, 0.25)
    assert torch.equal(later[0], first[0] + batch * 0.25)
    assert int(later[1]) == 0 and int(later[2]) == 0


@needs_ext
def test_non_contiguous_inputs() -> None:
    base_r, base_b = _case((6, 8), torch.float32)
    running, batch = base_r.t()[:4], base_b[:, ::2].t()  # both (4, 6), strided
    st, sk = _counts(-1, 0)
    got = torch.ops.kaisa.fold(running, batch, st, sk, 1, 0.5, 0.5)
    want = ref.fold(running.contiguous(), batch.contiguous(), st, sk, 1, 0.5, 0.5)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("backend", ["torch", pytest.param("ext", marks=needs_ext)])
def test_wrapper_on_every_backend_and_16_bit_factors(backend: str) -> None:
    with ops.use_backend(backend):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            running, batch = _case((3, 5, 5), dtype)
            got = ops.fold(running, batch, *_counts(-1, 0), round_=0, decay=0.9, weight=0.1)
            want = ref.fold(running, batch, *_counts(-1, 0), 0, 0.9, 0.1)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), dtype


@pytest.mark.parametrize(("args", "error", "match"), [
    (lambda r, b, s, k: (r, b[:2], s, k), ValueError, "batch must have running's shape"),
    (lambda r, b, s, k: (r, b.double(), s, k), ValueError, "batch must have running's"),
    (lambda r, b, s, k: (r.int(), b, s, k), TypeError, "running must have a floating"),
    (lambda r, b, s, k: (r, b, s.int(), k), ValueError, "stamp must be a 0-d int64"),
    (lambda r, b, s, k: (r, b, s, k.reshape(1)), ValueError, "skipped must be a 0-d int64"),
    (lambda r, b, s, k: (r, b, s, 3), TypeError, "skipped"),
])
def test_wrapper_rejects_bad_arguments(args: Any, error: type[Exception], match: str) -> None:
    running, batch = _case((3, 4, 4), torch.float32)
    st, sk = _counts(-1, 0)
    before = [t.clone() for t in (running, batch, st, sk)]
    with pytest.raises(error, match=match):
        ops.fold(*args(running, batch, st, sk), round_=0, decay=0.9, weight=0.1)
    for t, t0 in zip((running, batch, st, sk), before, strict=True):
        assert torch.equal(t, t0)


@needs_ext
def test_kernel_rejects_bad_arguments_when_called_directly() -> None:
    k = torch.ops.kaisa
    r, b = _case((3, 4, 4), torch.float32)
    st, sk = _counts(-1, 0)
    with pytest.raises(RuntimeError, match="kaisa fold: batch must have running's shape"):
        k.fold(r, b[:2], st, sk, 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="running must be float32 or float64"):
        k.fold(r.half(), b.half(), st, sk, 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="stamp must be a 0-d int64"):
        k.fold(r, b, st.int(), sk, 0, 0.9, 0.1)


@needs_ext
def test_opcheck_and_meta() -> None:
    r, b = _case((2, 5, 5), torch.float64)
    torch.library.opcheck(torch.ops.kaisa.fold.default, (r, b, *_counts(-1, 0), 0, 0.9, 0.1))
    meta = [t.to("meta") for t in (r, b, *_counts(-1, 0))]
    out = ops.fold(*meta, round_=0, decay=0.9, weight=0.1)
    assert [tuple(t.shape) for t in out] == [(2, 5, 5), (), ()]
