"""Cases shared by the op, CUDA and exactness tests (one place for each kind)."""

from __future__ import annotations

from typing import Any

# Op-level conv cases: (input shape, kernel, stride, padding, dilation, groups).
# Used by tests/ops/test_ops.py (both backends) and tests/ops/test_cuda_ops.py.
ConvOpCase = tuple[
    tuple[int, int, int, int], tuple[int, int], tuple[int, int], tuple[int, int],
    tuple[int, int], int,
]
CONV_OP_CASES: list[ConvOpCase] = [
    ((3, 8, 9, 11), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 6, 13, 10), (3, 2), (2, 1), (1, 0), (2, 1), 2),  # odd sizes, stride, dilation
    ((2, 6, 9, 9), (3, 3), (1, 1), (1, 1), (1, 1), 6),  # depthwise
    ((2, 8, 30, 30), (1, 1), (1, 1), (0, 0), (1, 1), 1),  # pointwise, plane-contiguous path
    ((3, 8, 7, 5), (1, 1), (1, 1), (0, 0), (1, 1), 2),  # pointwise, small planes
    ((2, 4, 9, 8), (1, 1), (2, 2), (0, 0), (1, 1), 1),  # 1x1 stride 2
    ((2, 3, 23, 21), (7, 7), (2, 2), (3, 3), (1, 1), 1),  # stem conv, d = 147 (3 tiles)
    ((2, 4, 11, 11), (3, 3), (2, 2), (2, 2), (2, 2), 2),  # stride 2 + dilation 2
    ((1, 5, 6, 6), (2, 2), (1, 1), (0, 0), (1, 1), 1),  # even kernel, N = 1
    ((2, 130, 7, 9), (1, 1), (1, 1), (0, 0), (1, 1), 1),  # 1x1, d > 2 tiles
    ((5, 16, 17, 19), (3, 3), (1, 1), (1, 1), (1, 1), 1),  # d = 144, 1615 rows: splits
    ((1, 12, 4, 4), (3, 3), (1, 1), (0, 0), (1, 1), 3),  # 2x2 output, ragged everything
    ((4, 64, 20, 20), (3, 3), (1, 1), (1, 1), (1, 1), 4),  # groups with d = 144
]


def conv_op_id(case: ConvOpCase) -> str:
    """A readable test id."""
    shape, ks, st, pd, dl, g = case
    geometry = f"k{ks[0]}{ks[1]}-s{st[0]}{st[1]}-p{pd[0]}{pd[1]}-d{dl[0]}{dl[1]}"
    return f"{'x'.join(map(str, shape))}-{geometry}-g{g}"


# Module-level conv cases (nn.Conv2d keyword arguments, incl. 'same' / 'valid').
CONV_MODULE_CASES: list[dict[str, Any]] = [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(in_channels=3, out_channels=4, kernel_size=3, padding=0, bias=False),
    dict(in_channels=2, out_channels=3, kernel_size=(3, 2), stride=2, padding=(1, 0)),
    dict(in_channels=3, out_channels=3, kernel_size=3, dilation=2, padding=2),
    dict(in_channels=3, out_channels=2, kernel_size=4, padding="same"),
    dict(in_channels=2, out_channels=3, kernel_size=(2, 3), dilation=(2, 1), padding="same"),
    dict(in_channels=3, out_channels=2, kernel_size=3, padding="valid", stride=(1, 2)),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4),  # depthwise
    dict(in_channels=3, out_channels=6, kernel_size=1, groups=3, bias=False),
    dict(in_channels=3, out_channels=4, kernel_size=1, stride=2),
]


def conv_module_id(case: dict[str, Any]) -> str:
    """A readable test id."""
    return "-".join(f"{k}{v}" for k, v in case.items())
