"""kaisa.losses: the targets' shape rules (docs/reliability.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa
from kaisa.losses import Loss

pytestmark = pytest.mark.usefixtures("float64")


def test_mse_targets_of_another_shape_name_both_shapes() -> None:
    loss = Loss.of("mse")
    with pytest.raises(ValueError, match=r"targets of shape \(8, 4\).*outputs of shape \(4, 8\)"):
        loss(torch.randn(4, 8), torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"\(4,\).*\(4, 1\)"):  # no (4, 4) broadcast either
        loss(torch.randn(4, 1), torch.randn(4))
    model = nn.Linear(3, 8)
    opt = kaisa.KFAC(model, loss="mse")
    with pytest.raises(ValueError, match=r"\(8, 4\).*\(4, 8\)"):
        opt.step(lambda: (model(torch.randn(4, 3)), torch.randn(8, 4)))


def test_sequence_cross_entropy_takes_class_logits_last_and_names_both_shapes() -> None:
    loss = Loss.of("cross_entropy")
    logits = torch.randn(2, 3, 5)  # (B, T, C)
    targets = torch.randint(0, 5, (2, 3))
    torch.testing.assert_close(loss(logits, targets),
                               F.cross_entropy(logits.permute(0, 2, 1), targets))
    with pytest.raises(ValueError, match=r"targets of shape \(3, 2\).*outputs of shape "
                                         r"\(2, 3, 5\).*must have shape \(2, 3\)"):
        loss(logits, targets.T)  # (T, B): today silently reshaped
