"""The shifted-correlation conv A factor (:mod:`kaisa.ops._shifted`) and its dispatch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import kaisa.ops as ops
from kaisa.ops import _reference as ref
from kaisa.ops import _shifted
from kaisa.ops._checks import ConvArgs
from kaisa.ops._shifted import conv_covariance_shifted, supports_shifted

HAS_EXT = ops.extension_available()


def _geometries() -> Iterator[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """Kernels, every padding up to the kernel size, image sizes down to 1x1."""
    for k in [(3, 3), (3, 2), (5, 3), (2, 4), (1, 3)]:
        for p in itertools.product(range(k[0] + 1), range(k[1] + 1)):
            for hw in [(1, 1), (2, 5), (6, 4)]:
                if all(hw[i] + 2 * p[i] - k[i] + 1 > 0 for i in (0, 1)):
                    yield k, p, hw


GEOMETRIES = list(_geometries())


@pytest.mark.parametrize("bias", [False, True])
def test_float64_equals_the_reference_for_every_geometry(bias: bool) -> None:
    torch.manual_seed(0)
    for k, p, (h, w) in GEOMETRIES:
        x = torch.randn(2, 3, h, w, dtype=torch.float64)
        got = conv_covariance_shifted(x, k, p, bias, 0.3)
        expected = ref.conv_covariance(x, k, (1, 1), p, (1, 1), 1, bias, 0.3)
        assert got.shape == expected.shape and got.dtype == torch.float64, (k, p, h, w)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=str((k, p, h, w)))
        assert torch.equal(got, got.transpose(1, 2))


def test_several_chunks_and_layouts() -> None:
    # 2 * 60 * 50 = 6000 positions per image pair plus padding: more than one chunk.
    x = torch.randn(4, 3, 60, 50, dtype=torch.float64)
    assert x.shape[0] * 62 * 52 > _shifted._CHUNK
    before = x.clone()
    got = conv_covariance_shifted(x, (3, 3), (1, 1), True, 1e-3)
    expected = ref.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 1e-3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(x, before)
    strided = torch.randn(4, 6, 61, 50, dtype=torch.float64)[:, ::2, 1:]
    channels_last = x.contiguous(memory_format=torch.channels_last)
    for layout in (strided, channels_last):
        torch.testing.assert_close(
            conv_covariance_shifted(layout, (3, 3), (1, 1), True, 1e-3),
            ref.conv_covariance(layout.contiguous(), (3, 3), (1, 1), (1, 1), (1, 1), 1, True,
                                1e-3), rtol=1e-12, atol=1e-12)


def test_float32_rounding_at_the_level_of_the_compiled_kernel() -> None:
    # Few channels, many positions: one unchunked GEMM per shift was 1e-5 off here.
    torch.manual_seed(0)
    x = torch.randn(64, 3, 32, 32) + 0.5
    truth = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 1 / 65536)
    got = conv_covariance_shifted(x, (3, 3), (1, 1), True, 1 / 65536)
    assert got.dtype == torch.float32
    error = ((got.double() - truth).abs().max() / truth.abs().max()).item()
    assert error < 3e-6


def test_no_output_position_gives_zeros() -> None:
    x = torch.randn(2, 3, 2, 2)
    got = conv_covariance_shifted(x, (5, 5), (1, 1), True, 1.0)
    assert torch.equal(got, torch.zeros(1, 76, 76))


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "dilation", "groups", "dtype", "device", "expected"),
    [
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.float32, "cpu", True),
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.float64, "cpu", True),
        ((64, 8, 8, 8), (1, 3), (1, 1), (1, 1), 1, torch.float32, "cpu", True),
        ((64, 8, 8, 8), (1, 1), (1, 1), (1, 1), 1, torch.float32, "cpu", False),
        ((64, 8, 8, 8), (3, 3), (2, 1), (1, 1), 1, torch.float32, "cpu", False),
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 2), 1, torch.float32, "cpu", False),
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 1), 2, torch.float32, "cpu", False),
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.bfloat16, "cpu", False),
        ((64, 8, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.float32, "meta", False),
        ((64, 3, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.float32, "cpu", False),  # channels
        ((256, 8, 4, 4), (3, 3), (1, 1), (1, 1), 1, torch.float32, "cpu", False),  # side
        ((63, 8, 8, 8), (3, 3), (1, 1), (1, 1), 1, torch.float32, "cpu", False),  # positions
    ],
)
def test_supports(shape: tuple[int, ...], kernel: tuple[int, int], stride: tuple[int, int],
                  dilation: tuple[int, int], groups: int, dtype: torch.dtype, device: str,
                  expected: bool) -> None:
    x = torch.empty(*shape, dtype=dtype, device=device)
    conv = ConvArgs(kernel, stride, (1, 1), dilation, groups)
    assert supports_shifted(x, conv) is expected
    assert not supports_shifted(x[:0], conv)


def test_positions_count_the_padding() -> None:
    x = torch.empty(64, 8, 8, 8)  # 4096 output positions with padding 1, 2304 without
    assert supports_shifted(x, ConvArgs((3, 3), (1, 1), (1, 1), (1, 1), 1))
    assert not supports_shifted(x, ConvArgs((3, 3), (1, 1), (0, 0), (1, 1), 1))


@pytest.mark.skipif(not HAS_EXT, reason="kaisa._C extension not available")
@pytest.mark.parametrize("backend", ["ext", "torch"])
def test_dispatch(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """The ext backend takes the path on the CPU where it pays; the torch backend never."""
    calls: list[Any] = []
    real = _shifted.conv_covariance_shifted

    def spy(*args: Any) -> torch.Tensor:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_shifted, "conv_covariance_shifted", spy)
    x = torch.randn(64, 8, 8, 8, dtype=torch.float64)
    with ops.use_backend(backend):
        got = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 0.5)
        ops.conv_covariance(x, (3, 3), (2, 2), (1, 1), (1, 1), 1, True, 0.5)
        ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 2, True, 0.5)
        ops.conv_covariance(x[:8], (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 0.5)
    assert len(calls) == (1 if backend == "ext" else 0)
    expected = ref.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 0.5)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.slow  # subprocesses / long: the full suite runs it
@pytest.mark.skipif(not HAS_EXT, reason="kaisa._C extension not available")
def test_traced_by_torch_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    real = _shifted.conv_covariance_shifted
    monkeypatch.setattr(_shifted, "conv_covariance_shifted",
                        lambda *args: calls.append(args) or real(*args))
    x = torch.randn(64, 8, 8, 8)

    def factor(t: torch.Tensor) -> torch.Tensor:
        return ops.conv_covariance(t, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, 1 / 4096)

    with ops.use_backend("ext"):
        torch._dynamo.reset()
        compiled = torch.compile(factor, fullgraph=True, backend="aot_eager")(x)
        eager = factor(x)
    assert len(calls) == 2  # traced once, run once
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.skipif(not HAS_EXT, reason="kaisa._C extension not available")
def test_a_finite_factor_whose_sum_overflows_stays_finite() -> None:
    """The overflow prescaling of :func:`kaisa.ops.conv_covariance` covers this path too."""
    x = torch.full((64, 8, 8, 8), 1.2e19)
    x[:, :, 0] = -1.2e19
    scale = 1 / (64 * 64)
    with ops.use_backend("ext"):
        got = ops.conv_covariance(x, (3, 3), (1, 1), (1, 1), (1, 1), 1, True, scale)
    expected = ref.conv_covariance(x.double(), (3, 3), (1, 1), (1, 1), (1, 1), 1, True, scale)
    assert torch.isfinite(got).all()
    # Constant products round alike: 8192-row partial sums were 2.6e-5 off, the compiled
    # kernel 2.3e-6.
    assert float((got.double() - expected).abs().max() / expected.abs().max()) < 1e-5
