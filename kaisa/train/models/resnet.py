"""CIFAR-style residual networks (He et al., 2016, section 4.2).

``resnet20``/``resnet32``/``resnet56`` have three stages of BasicBlocks with
16, 32 and 64 channels and ``6n + 2`` weighted layers. The networks end in a
global average pool, so they accept any image size: 32x32 CIFAR images as in
the paper, and the 8x8 digits images directly (no upsampling; the last stage
then works on 2x2 feature maps).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Shortcut = Literal["A", "B"]


class _PadShortcut(nn.Module):
    """Option-A shortcut: subsample spatially and zero-pad the channels."""

    def __init__(self, *, out_channels: int, stride: int) -> None:
        super().__init__()
        self.out_channels = out_channels
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` subsampled by ``stride`` and padded to ``out_channels``."""
        x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - x.shape[1]
        return F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection."""

    def __init__(
        self, *, in_channels: int, out_channels: int, stride: int = 1, shortcut: Shortcut = "A"
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            if shortcut == "A":
                self.shortcut = _PadShortcut(out_channels=out_channels, stride=stride)
            else:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                    nn.BatchNorm2d(out_channels),
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet with three stages of ``blocks_per_stage`` BasicBlocks."""

    def __init__(
        self,
        *,
        blocks_per_stage: int,
        num_classes: int = 10,
        in_channels: int = 3,
        shortcut: Shortcut = "A",
    ) -> None:
        super().__init__()
        if blocks_per_stage < 1:
            raise ValueError(f"blocks_per_stage must be >= 1, got {blocks_per_stage}")
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        self.conv1 = nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(
                    BasicBlock(
                        in_channels=channels, out_channels=width, stride=stride, shortcut=shortcut
                    )
                )
                channels = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for images ``x`` of shape ``(N, C, H, W)``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)  # type: ignore[no-any-return]


def resnet20(
    *, num_classes: int = 10, in_channels: int = 3, shortcut: Shortcut = "A"
) -> CifarResNet:
    """ResNet-20 (0.27M parameters)."""
    return CifarResNet(
        blocks_per_stage=3, num_classes=num_classes, in_channels=in_channels, shortcut=shortcut
    )


def resnet32(
    *, num_classes: int = 10, in_channels: int = 3, shortcut: Shortcut = "A"
) -> CifarResNet:
    """ResNet-32 (0.46M parameters)."""
    return CifarResNet(
        blocks_per_stage=5, num_classes=num_classes, in_channels=in_channels, shortcut=shortcut
    )


def resnet56(
    *, num_classes: int = 10, in_channels: int = 3, shortcut: Shortcut = "A"
) -> CifarResNet:
    """ResNet-56 (0.85M parameters)."""
    return CifarResNet(
        blocks_per_stage=9, num_classes=num_classes, in_channels=in_channels, shortcut=shortcut
    )
