"""A small model with Linear layers on sequences, and its data (curvlinops oracle tests)."""

from __future__ import annotations

import torch
from torch import nn

#: Examples, positions per example, output dimension (classes).
N, T, C = 4, 5, 3


class Sequence(nn.Module):
    """Two Linear layers over (N, T, features), position by position; outputs (N*T, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 7)
        self.last = nn.Linear(7, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.first(x))).reshape(-1, C)


def sequence_data(loss: str = "cross_entropy") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (N, T, 6) and targets: classes (N*T,) or, for ``'mse'``, (N*T, C)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, T, 6, generator=g)
    if loss == "mse":
        return x, torch.randn(N * T, C, generator=g)
    return x, torch.randint(0, C, (N * T,), generator=g)
