"""One finiteness check for whole tensors, kept on the device.

``torch.isfinite(t).all()`` materialises a boolean tensor; the minimum and maximum of
``t`` (NaN propagates through both, infinities show up in them) answer the same question
about 15x faster on CPU for a 257 x 257 factor, and unlike a sum they cannot overflow and
wrongly reject a finite tensor.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["all_finite"]


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: whether every element of the floating-point ``t`` is finite.

    Of a ``DTensor`` (FSDP2), this rank's shard only (which may be empty): the callers
    combine the ranks' answers.
    """
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    lo, hi = torch.aminmax(t)
    return torch.isfinite(lo) & torch.isfinite(hi)
