"""What preconditioning returns for one block."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kaisa.blocks.base import CurvatureBlock

__all__ = ["Preconditioned"]


@dataclass(frozen=True)
class Preconditioned:
    """One block's preconditioned gradient, as the curvature core returns it.

    Attributes:
        block: The block.
        grad: Its gradient matrix ``(groups, m, n)``.
        direction: The preconditioned matrix, same shape.
        valid: For a gradient received from another rank, a 0-d bool tensor saying
            whether the sender had a result; ``None`` for one computed here.
        inner: For a block FSDP2 shards, whose ``grad`` and ``direction`` are only the
            rows this rank holds (:func:`~kaisa.utils.shards.take_held`): the
            whole block's ``<direction, grad>`` (float64, 0-d); ``None`` otherwise.
        finite: For such a block, whether the whole ``direction`` is finite (0-d bool).
    """

    block: CurvatureBlock
    grad: torch.Tensor
    direction: torch.Tensor
    valid: torch.Tensor | None = None
    inner: torch.Tensor | None = None
    finite: torch.Tensor | None = None
