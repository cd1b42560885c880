"""ImageNet-style ResNet-50 with bottleneck blocks (for throughput runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand (x4) with a projection shortcut when needed."""

    expansion = 4

    def __init__(self, *, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNet50(nn.Module):
    """ResNet-50: 7x7 stem, max-pool, four bottleneck stages [3, 4, 6, 3]."""

    def __init__(self, *, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        channels = 64
        for stage, (width, count) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            for index in range(count):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(Bottleneck(in_channels=channels, width=width, stride=stride))
                channels = width * Bottleneck.expansion
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for images ``x`` of shape ``(N, C, H, W)``."""
        out = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))  # type: ignore[no-any-return]


def resnet50(*, num_classes: int = 1000, in_channels: int = 3) -> ResNet50:
    """Build ResNet-50 (25.6M parameters with 1000 classes)."""
    return ResNet50(num_classes=num_classes, in_channels=in_channels)
