"""The EKFAC optimizer, :class:`kaisa.EKFAC`: Adam in the eigenbasis of the K-FAC factors.

The optimizer (:mod:`kaisa.ekfac.optimizer`, a ``torch.optim.Optimizer`` with AdamW's
arguments) and its configuration (:mod:`kaisa.ekfac.config`: the core's settings decided
in one place, how a basis refresh is computed).
"""

from __future__ import annotations

from kaisa.ekfac.config import BasisRefresh, EKFACConfig
from kaisa.ekfac.optimizer import EKFAC

__all__ = ["EKFAC", "BasisRefresh", "EKFACConfig"]
