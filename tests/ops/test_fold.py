"""``kaisa.ops.fold`` and ``fold_many``: micro-batch factors folded into running factors.

The op ``kaisa::fold`` takes lists (``fold`` is its one-tensor case). The CPU kernel equals
the reference bit for bit (each product and the sum rounded on its own) on every branch:
the round's first fold (scaled by ``decay``), a later one (not scaled), a non-finite batch
(NaN, +inf, -inf: skipped and counted), odd, empty and non-contiguous shapes, and lists
mixing them (one factor skipped while the next is folded, more tensors than the CUDA
kernels' chunk of 8); the wrappers and the kernel reject bad arguments with clear errors
(naming the index) and modify nothing. The CUDA kernels: ``tests/ops/test_cuda_ops.py``
(under the emulator).
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


def _op(running: torch.Tensor, batch: torch.Tensor, stamp: torch.Tensor,
        skipped: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, ...]:
    """The list op called with one tensor each, its one result each."""
    outs, stamps, counts = torch.ops.kaisa.fold([running], [batch], [stamp], [skipped], *rest)
    assert len(outs) == len(stamps) == len(counts) == 1
    return outs[0], stamps[0], counts[0]


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
    got = _op(running, batch, st, sk, 4, 0.95, 0.05 / 3)
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
    got = _op(running, batch, st, sk, 1, 0.5, 0.5)
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
    r, b = _case((3, 4, 4), torch.float32)
    st, sk = _counts(-1, 0)
    with pytest.raises(RuntimeError, match="kaisa fold: batch must have running's shape"):
        _op(r, b[:2], st, sk, 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="running must be float32 or float64"):
        _op(r.half(), b.half(), st, sk, 0, 0.9, 0.1)
    with pytest.raises(RuntimeError, match="stamp must be a 0-d int64"):
        _op(r, b, st.int(), sk, 0, 0.9, 0.1)


@needs_ext
def test_opcheck_and_meta() -> None:
    r, b = _case((2, 5, 5), torch.float64)
    r2, b2 = _case((3, 4), torch.float64, bad=math.nan, seed=1)
    lists = ([r, r2.t()], [b, b2.t()], *([t, t.clone()] for t in _counts(-1, 0)))
    torch.library.opcheck(torch.ops.kaisa.fold.default, (*lists, 0, 0.9, 0.1))
    meta = [t.to("meta") for t in (r, b, *_counts(-1, 0))]
    out = ops.fold(*meta, round_=0, decay=0.9, weight=0.1)
    assert [tuple(t.shape) for t in out] == [(2, 5, 5), (), ()]
    metas = [[t.to("meta") for t in ts] for ts in lists]
    outs, stamps, counts = ops.fold_many(*metas, round_=0, decay=0.9, weight=0.1)
    assert [tuple(t.shape) for t in outs] == [(2, 5, 5), (4, 3)]
    assert all(t.is_contiguous() for t in outs)
    assert [tuple(t.shape) for t in (*stamps, *counts)] == [()] * 4


# --------------------------------------------------------------------------- #
# lists: fold_many and the list op
# --------------------------------------------------------------------------- #

# Stamps and bad entries cycled over a list: first and later folds, finite and not.
BRANCHES = [(-1, None), (4, math.nan), (4, None), (-1, math.inf), (-1, -math.inf)]


def _lists(shapes: list[tuple[int, ...]], dtype: torch.dtype,
           ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                      list[torch.Tensor]]:
    """Running and batch factors of ``shapes`` (every third transposed: non-contiguous),
    with the stamps and bad entries of :data:`BRANCHES` in turn."""
    running, batch, stamps, counts = [], [], [], []
    for i, shape in enumerate(shapes):
        stamp, bad = BRANCHES[i % len(BRANCHES)]
        r, b = _case(shape, dtype, bad=bad, seed=i)
        if i % 3 == 2 and r.dim() >= 2:
            r, b = r.mT, b.mT
        running.append(r)
        batch.append(b)
        stamps.append(torch.tensor(stamp))
        counts.append(torch.tensor(i))
    return running, batch, stamps, counts


def _want(running: list[torch.Tensor], batch: list[torch.Tensor], stamps: list[torch.Tensor],
          counts: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    return [ref.fold(r.contiguous(), b.contiguous(), st, sk, 4, 0.95, 0.05 / 3)
            for r, b, st, sk in zip(running, batch, stamps, counts, strict=True)]


LIST_SHAPES = {
    "a_and_g": [(1, 9, 9), (1, 4, 4)],  # one block's sides: G finite after a NaN A
    "mixed": [(3, 7, 7), (0, 4, 4), (5,), (2, 33), (1, 300, 300), (6, 8)],
    "longer_than_a_chunk": [(2, k % 5 + 1, k % 5 + 1) for k in range(19)],
}


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(LIST_SHAPES))
def test_list_op_equals_the_reference_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    running, batch, stamps, counts = _lists(LIST_SHAPES[name], dtype)
    before = [[t.clone() for t in ts] for ts in (running, batch, stamps, counts)]
    outs, new_stamps, new_counts = torch.ops.kaisa.fold(running, batch, stamps, counts, 4, 0.95,
                                                        0.05 / 3)
    want = _want(running, batch, stamps, counts)
    assert len(outs) == len(new_stamps) == len(new_counts) == len(want)
    for i, got in enumerate(zip(outs, new_stamps, new_counts, strict=True)):
        for g, w in zip(got, want[i], strict=True):
            assert torch.equal(g, w) and g.dtype == w.dtype and g.is_contiguous(), i
        folded = BRANCHES[i % len(BRANCHES)][1] is None or batch[i].numel() == 0
        assert int(got[2]) == i + (0 if folded else 1), i  # each tensor on its own
    for ts, ts0 in zip((running, batch, stamps, counts), before, strict=True):
        for t, t0 in zip(ts, ts0, strict=True):  # inputs untouched
            torch.testing.assert_close(t, t0, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["torch", pytest.param("ext", marks=needs_ext)])
def test_fold_many_is_fold_of_each(backend: str) -> None:
    with ops.use_backend(backend):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            lists = _lists(LIST_SHAPES["mixed"], dtype)
            outs, stamps, counts = ops.fold_many(*lists, round_=4, decay=0.95, weight=0.05 / 3)
            for i, got in enumerate(zip(outs, stamps, counts, strict=True)):
                one = ops.fold(*(ts[i] for ts in lists), round_=4, decay=0.95, weight=0.05 / 3)
                assert all(torch.equal(g, w) for g, w in zip(got, one, strict=True)), (dtype, i)
        assert ops.fold_many([], [], [], [], round_=0, decay=0.9, weight=0.1) == ([], [], [])


def _bad_lists(kind: str, r: list[torch.Tensor], b: list[torch.Tensor], s: list[torch.Tensor],
               k: list[torch.Tensor]) -> tuple[Any, ...]:
    if kind == "length":
        return r, b[:1], s, k
    if kind == "dtypes":
        return [r[0], r[1].double()], [b[0], b[1].double()], s, k
    if kind == "devices":
        return ([r[0], r[1].to("meta")], [b[0], b[1].to("meta")], s,
                [k[0], k[1].to("meta")])
    if kind == "shape":
        return r, [b[0], b[1][:1]], s, k
    if kind == "stamp":
        return r, b, [s[0], s[1].reshape(1)], k
    return r, b, s, (k[0], 3)  # not a tensor


BAD_LISTS = [
    ("length", ValueError, "must be lists of one length, got 2, 1, 2 and 2"),
    ("dtypes", ValueError, "running must have one dtype and one device.*at index 1"),
    ("devices", ValueError, "running must have one dtype and one device.*meta at index 1"),
    ("shape", ValueError, "batch must have running's shape.* at index 1"),
    ("stamp", ValueError, "stamp must be a 0-d int64 tensor on cpu at index 1"),
    ("tensor", TypeError, "skipped must be a torch.Tensor"),
]


@pytest.mark.parametrize(("kind", "error", "match"), BAD_LISTS, ids=[b[0] for b in BAD_LISTS])
def test_fold_many_rejects_bad_arguments(kind: str, error: type[Exception], match: str) -> None:
    lists = _lists([(3, 4, 4), (2, 5, 5)], torch.float32)
    before = [[t.clone() for t in ts] for ts in lists]
    with pytest.raises(error, match=match):
        ops.fold_many(*_bad_lists(kind, *lists), round_=0, decay=0.9, weight=0.1)
    for ts, ts0 in zip(lists, before, strict=True):
        for t, t0 in zip(ts, ts0, strict=True):
            torch.testing.assert_close(t, t0, rtol=0, atol=0, equal_nan=True)


KERNEL_BAD_LISTS = [
    ("length", "kaisa fold: running, batch, stamp and skipped must be lists of one length, "
               "got 2, 1, 2 and 2"),
    ("dtypes", "kaisa fold: running must have one dtype: Float at index 0, Double at index 1"),
    ("devices", "kaisa fold: running must be on one device: cpu at index 0, meta at index 1"),
    ("shape", r"kaisa fold: batch must have running's shape \[2, 5, 5\] at index 1"),
    ("stamp", "kaisa fold: stamp must be a 0-d int64 tensor at index 1"),
]


@needs_ext
@pytest.mark.parametrize(("kind", "match"), KERNEL_BAD_LISTS, ids=[b[0] for b in KERNEL_BAD_LISTS])
def test_cpu_kernel_rejects_bad_lists(kind: str, match: str) -> None:
    lists = _lists([(3, 4, 4), (2, 5, 5)], torch.float32)
    before = [[t.clone() for t in ts] for ts in lists]
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)  # the kernel, even given meta
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kaisa.fold.default.redispatch(cpu, *_bad_lists(kind, *lists), 0, 0.9, 0.1)
    for ts, ts0 in zip(lists, before, strict=True):
        for t, t0 in zip(ts, ts0, strict=True):
            torch.testing.assert_close(t, t0, rtol=0, atol=0, equal_nan=True)
