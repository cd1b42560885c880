"""fold_all: many blocks' running averages in a few multi-tensor calls, bit for bit as one by one.

``RunningFactors.fold_micro``: a block's A and G micro-batch factors in one
``kaisa.ops.fold_many`` call, each side bit for bit as folded on its own.
"""

from __future__ import annotations

import collections
import copy
import math
from typing import Any

import pytest
import torch

from kaisa.blocks import state
from kaisa.blocks.state import RunningFactors, fold_all
from kaisa.utils.enums import Side
from tests.support.calls import Calls


def _factors(seed: int, shapes: list[tuple[int, ...]], dtype: torch.dtype
             ) -> list[tuple[RunningFactors, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        diagonal = frozenset({Side.A, Side.G}) if len(shape) == 2 else frozenset()
        running = RunningFactors(diagonal_sides=diagonal)
        a = torch.randn(*shape, generator=gen, dtype=dtype)
        g = torch.randn(*shape, generator=gen, dtype=dtype)
        if i % 3 != 2:  # some blocks fold for the first time in the call under test
            running.fold(a, g, 0.9)
        a_batch = torch.randn(*shape, generator=gen, dtype=dtype)
        g_batch = torch.randn(*shape, generator=gen, dtype=dtype)
        out.append((running, a_batch, g_batch))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [64 * 2**20, 300])
def test_fold_all_equals_folding_one_by_one(dtype: torch.dtype, chunk: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state, "FOLD_CHUNK_BYTES", chunk)  # 300 bytes: a chunk per factor
    shapes = [(1, 5, 5), (1, 5, 5), (2, 3, 3), (1, 7, 7), (1, 6), (1, 5, 5), (1, 4, 4)]
    items = _factors(0, shapes, dtype)
    items[1][1][0, 1, 2] = float("nan")  # a non-finite A batch: skipped and counted
    items[3][2][0, 0, 0] = float("inf")  # an infinite G batch
    items[5][2].fill_(float("-inf"))
    one_by_one = copy.deepcopy(items)
    for running, a, g in one_by_one:
        running.fold(a, g, 0.95)
    fold_all(items, 0.95)
    for (got, _, _), (want, _, _) in zip(items, one_by_one, strict=True):
        for key in ("a", "g", "skipped_a", "skipped_g"):
            assert torch.equal(getattr(got, key), getattr(want, key)), key
    assert [r.skipped for r, _, _ in items] == [0, 1, 0, 1, 0, 1, 0]


def test_fold_all_zero_start_and_missing_batches() -> None:
    items = _factors(1, [(1, 4, 4), (1, 4, 4), (1, 4, 4)], torch.float64)
    items = [(items[0][0], None, items[0][2]), (items[1][0], items[1][1], None), items[2]]
    one_by_one = copy.deepcopy(items)
    for running, a, g in one_by_one:
        running.fold(a, g, 0.5, zero_start=True)
    fold_all(items, 0.5, zero_start=True)
    for (got, _, _), (want, _, _) in zip(items, one_by_one, strict=True):
        for key in ("a", "g", "skipped_a", "skipped_g"):
            x, y = getattr(got, key), getattr(want, key)
            assert (x is None and y is None) or torch.equal(x, y), key




@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("broken", [False, True])
def test_fold_all_makes_one_where_per_factor_and_no_other_per_factor_call(
    device: str, broken: bool
) -> None:
    """The calls do not grow with the blocks, but for one ``where`` per factor.

    On a device (``meta`` stands in for a GPU here) the choice stays there: a ``where`` per
    factor and no host read. On the CPU the flags are read from memory: no ``where`` at all
    when every batch factor is finite, one per factor when one is not.
    """

    def count(blocks: int) -> collections.Counter[str]:
        items = _factors(2, [(1, 6, 6)] * blocks, torch.float32)
        for running, a, g in items:  # every block folded once already
            running.fold(a, g, 0.9)
        if broken:
            items[0][1].fill_(float("nan"))
        items = [(RunningFactors(*(None if t is None else t.to(device) for t in (
            running.a, running.g, running.skipped_a, running.skipped_g))),
            a.to(device), g.to(device)) for running, a, g in items]
        calls = Calls()
        with calls:
            fold_all(items, 0.9)
        return calls.calls

    few, many = count(4), count(12)
    per_factor = device != "cpu" or broken
    assert many["aten.where"] == (24 if per_factor else 0)
    assert few["aten.where"] == (8 if per_factor else 0)
    assert {k: v for k, v in few.items() if k not in ("aten.where", "aten.unbind")} == {
        k: v for k, v in many.items() if k not in ("aten.where", "aten.unbind")}
    assert "aten._local_scalar_dense" not in many  # no host synchronisation


def test_fold_all_on_the_cpu_skips_a_non_finite_factor_as_the_device_does() -> None:
    items = _factors(5, [(1, 4, 4), (2, 3, 3)], torch.float32)
    for running, a, g in items:
        running.fold(a, g, 0.9)
    items[1][2].view(-1)[3] = float("inf")
    before = [(r.a.clone(), r.g.clone()) for r, _, _ in items if r.a is not None and r.g is not None]
    expected = [(r.a * 0.9 + a * 0.1, r.g * 0.9 + g * 0.1) for r, a, g in items
                if r.a is not None and r.g is not None]
    fold_all(items, 0.9)
    (r0, _, _), (r1, _, _) = items
    assert torch.equal(r0.a, expected[0][0]) and torch.equal(r0.g, expected[0][1])
    assert torch.equal(r1.a, expected[1][0]) and torch.equal(r1.g, before[1][1])
    assert r0.skipped == 0 and r1.skipped == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_each_equals_all_finite_per_tensor(dtype: torch.dtype) -> None:
    from kaisa.utils.finite import all_finite, finite_each

    big = torch.finfo(dtype).max
    ts = [torch.randn(4, 4).to(dtype), torch.full((3,), big, dtype=dtype),  # no overflow
          torch.tensor([1.0, float("nan")], dtype=dtype), torch.tensor([float("-inf")]).to(dtype),
          torch.empty(0, dtype=dtype), torch.tensor(2.0, dtype=dtype)]
    mixed = [*ts, torch.tensor([float("inf")], dtype=torch.float64)]
    for case in (ts, mixed, ts[:1]):
        assert finite_each(case).tolist() == [bool(all_finite(t)) for t in case]


@pytest.mark.parametrize("packed", [False, True])
def test_fold_micro_folds_both_sides_in_one_call_each_on_its_own(
        packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    sizes: list[int] = []
    fold_many = state.ops.fold_many

    def counted(*args: Any, **kwargs: Any) -> Any:
        sizes.append(len(args[0]))
        return fold_many(*args, **kwargs)

    monkeypatch.setattr(state.ops, "fold_many", counted)
    gen = torch.Generator().manual_seed(5)
    both, apart = RunningFactors(packed=packed), RunningFactors(packed=packed)
    nan = torch.full((1, 4, 4), math.nan)
    steps: list[tuple[int, torch.dtype, torch.dtype, bool]] = [  # round, A, G dtype, G bad
        (0, torch.float32, torch.float32, False),  # both start from the identity
        (0, torch.float32, torch.float32, True),  # later in the round; G skipped, A folded
        (1, torch.float32, torch.float32, False),  # a new round: both scaled
        (2, torch.float64, torch.float32, False),  # A restarts in float64: two calls
    ]
    for round_, a_dtype, g_dtype, g_bad in steps:
        a = (lambda x: x @ x.mT)(torch.randn(1, 3, 3, generator=gen)).to(a_dtype)
        g = nan if g_bad else (lambda x: x @ x.mT)(torch.randn(1, 4, 4, generator=gen))
        g = g.to(g_dtype)
        sizes.clear()
        both.fold_micro(a, g, rho=0.9, weight=0.05, round_=round_)
        assert sizes == ([2] if a_dtype == g_dtype else [1, 1])
        apart.fold_micro(a, None, rho=0.9, weight=0.05, round_=round_)
        apart.fold_micro(None, g, rho=0.9, weight=0.05, round_=round_)
        for name in ("a", "g", "stamp_a", "stamp_g", "skipped_a", "skipped_g"):
            got, want = getattr(both, name), getattr(apart, name)
            assert got.dtype == want.dtype and torch.equal(got, want), (round_, name)
    assert both.a is not None and both.a.dtype == torch.float64
    assert int(both.skipped_g) == 1 and int(both.skipped_a) == 0  # type: ignore[arg-type]
    assert both.dense(Side.G) is not None and both.dense(Side.G).shape == (1, 4, 4)
