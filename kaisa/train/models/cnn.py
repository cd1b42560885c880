"""Small convolutional classifier for digits-sized (8x8) images."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 3x3 conv layers, a 2x2 max-pool and two linear layers.

    Sized for 8x8 inputs but works for any even ``image_size``.
    """

    def __init__(
        self, *, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, width: int = 16
    ) -> None:
        super().__init__()
        if image_size < 2 or image_size % 2:
            raise ValueError(f"image_size must be an even number >= 2, got {image_size}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        flat = 2 * width * (image_size // 2) ** 2
        self.classifier = nn.Sequential(nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits for images ``x`` of shape ``(N, C, H, W)``."""
        return self.classifier(self.features(x))  # type: ignore[no-any-return]


def cnn(
    *, in_channels: int = 1, image_size: int = 8, num_classes: int = 10, width: int = 16
) -> SmallCNN:
    """Build the small digits CNN."""
    return SmallCNN(
        in_channels=in_channels, image_size=image_size, num_classes=num_classes, width=width
    )
