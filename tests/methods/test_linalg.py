"""Unit tests of the decomposition ladder (kaisa.methods.linalg): batching and float64 retries."""

from __future__ import annotations

import logging

import pytest
import torch

from kaisa import ops
from kaisa.methods import linalg


def _spd(blocks: int, n: int) -> torch.Tensor:
    x = torch.randn(blocks, n, n + 2)
    return x @ x.mT / n + 0.1 * torch.eye(n)


def test_eigen_decompositions_batch_by_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = ops.eigh

    def counting(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(a.shape))
        return real(a)

    monkeypatch.setattr(ops, "eigh", counting)
    factors = [_spd(1, 4), None, _spd(2, 4), _spd(1, 6)]
    res = linalg.eigen_decompositions(factors, inv_dtype=torch.float32)
    assert sorted(calls) == [(1, 6, 6), (3, 4, 4)]  # one call per size
    assert res[1] is None
    for f, r in zip(factors, res, strict=True):
        if f is None:
            continue
        assert r is not None and r.eigenvalues.dtype == torch.float32
        recon = r.eigenvectors @ torch.diag_embed(r.eigenvalues) @ r.eigenvectors.mT
        torch.testing.assert_close(recon, f, rtol=1e-4, atol=1e-4)


def test_failing_factor_is_retried_in_float64_then_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = ops.eigh

    def flaky(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("simulated float32 failure")
        return real(a)

    monkeypatch.setattr(ops, "eigh", flaky)
    good, bad = _spd(1, 3), torch.full((1, 3, 3), float("nan"))
    with caplog.at_level(logging.WARNING, logger="kaisa"):
        res = linalg.eigen_decompositions([good, bad], inv_dtype=torch.float32, names=["g", "b"])
    assert res[0] is not None and res[0].eigenvalues.dtype == torch.float32
    assert res[1] is None
    assert "g retried in float64" in caplog.text and "b failed" in caplog.text


def test_damped_inverses() -> None:
    f = _spd(2, 5).double()
    (inv,) = linalg.damped_inverses([f], damping=0.3, inv_dtype=torch.float64)
    assert inv is not None
    torch.testing.assert_close(inv @ (f + 0.3 * torch.eye(5, dtype=torch.float64)),
                               torch.eye(5, dtype=torch.float64).expand(2, 5, 5))
    (none,) = linalg.damped_inverses(
        [torch.full((1, 2, 2), float("nan"))], damping=0.1, inv_dtype=torch.float32
    )
    assert none is None


def test_damped_inverses_batched_by_size_isolate_a_bad_factor(caplog) -> None:
    good, other, bad = _spd(2, 4).double(), _spd(1, 3).double(), torch.full((1, 4, 4), float("nan"))
    damping = [torch.tensor([0.1, 0.2], dtype=torch.float64), 0.3, 0.1]
    with caplog.at_level(logging.WARNING, logger="kaisa"):
        inv_good, inv_other, inv_bad = linalg.damped_inverses(
            [good, other, bad], damping=damping, inv_dtype=torch.float64, names=["g", "o", "b"]
        )
    assert inv_bad is None and "b failed" in caplog.text and "of g" not in caplog.text
    eye4, eye3 = torch.eye(4, dtype=torch.float64), torch.eye(3, dtype=torch.float64)
    for k, d in enumerate((0.1, 0.2)):
        torch.testing.assert_close(inv_good[k], torch.linalg.inv(good[k] + d * eye4))
    torch.testing.assert_close(inv_other[0], torch.linalg.inv(other[0] + 0.3 * eye3))
