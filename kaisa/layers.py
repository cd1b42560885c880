"""The former name of :mod:`kaisa.blocks` (kept so existing imports work)."""

from __future__ import annotations

from kaisa.blocks import (
    BLOCK_KINDS,
    BatchStatistics,
    Conv2dBlock,
    CurvatureBlock,
    KFACLayer,
    LinearBlock,
    RunningFactors,
    register_blocks,
)

__all__ = [
    "LAYER_KINDS",
    "BatchStatistics",
    "Conv2dLayer",
    "CurvatureBlock",
    "KFACLayer",
    "LinearLayer",
    "RunningFactors",
    "register_layers",
]

LAYER_KINDS = BLOCK_KINDS
Conv2dLayer = Conv2dBlock
LinearLayer = LinearBlock
register_layers = register_blocks
