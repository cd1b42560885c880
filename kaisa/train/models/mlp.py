"""Fully connected models: a classifier MLP and the deep autoencoder."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Module):
    """ReLU multilayer perceptron over flattened inputs."""

    def __init__(
        self, *, input_dim: int = 64, hidden_dims: Sequence[int] = (128, 128), num_classes: int = 10
    ) -> None:
        super().__init__()
        if input_dim < 1 or num_classes < 1 or any(h < 1 for h in hidden_dims):
            raise ValueError("input_dim, hidden_dims and num_classes must be positive")
        layers: list[nn.Module] = [nn.Flatten()]
        width = input_dim
        for hidden in hidden_dims:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)``."""
        return self.net(x)  # type: ignore[no-any-return]


class Autoencoder(nn.Module):
    """Deep tanh autoencoder with mirrored encoder and decoder.

    The classic K-FAC benchmark (Martens & Grosse, 2015). For 64-dimensional
    digits the layer widths are 64-256-128-64-16-64-128-256-64. Every hidden
    layer (the 16-unit code included) uses tanh; the output layer is linear.
    Train it with MSE against the input.
    """

    def __init__(
        self, *, input_dim: int = 64, hidden_dims: Sequence[int] = (256, 128, 64, 16)
    ) -> None:
        super().__init__()
        if input_dim < 1 or not hidden_dims or any(h < 1 for h in hidden_dims):
            raise ValueError("input_dim and hidden_dims must be positive and non-empty")
        widths = [input_dim, *hidden_dims, *reversed(hidden_dims[:-1]), input_dim]
        layers: list[nn.Module] = [nn.Flatten()]
        for fan_in, fan_out in itertools.pairwise(widths):
            layers += [nn.Linear(fan_in, fan_out), nn.Tanh()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the reconstruction of ``x``, flattened to ``(N, input_dim)``."""
        return self.net(x)  # type: ignore[no-any-return]


def mlp(
    *, input_dim: int = 64, hidden_dims: Sequence[int] = (128, 128), num_classes: int = 10
) -> MLP:
    """Build a ReLU MLP classifier."""
    return MLP(input_dim=input_dim, hidden_dims=hidden_dims, num_classes=num_classes)


def autoencoder(
    *, input_dim: int = 64, hidden_dims: Sequence[int] = (256, 128, 64, 16)
) -> Autoencoder:
    """Build the deep tanh autoencoder (64-256-128-64-16-64-128-256-64 for digits)."""
    return Autoencoder(input_dim=input_dim, hidden_dims=hidden_dims)
