"""Sharded checkpoints of a model, its optimizer and its K-FAC state, at any world size.

:func:`save` and :func:`load` (every rank calls both) go through
``torch.distributed.checkpoint`` (:mod:`kaisa.checkpoint.dcp`, which describes the
layout); :mod:`kaisa.checkpoint.optim` keys an optimizer's per-parameter state by
parameter name, for the optimizers DCP's helpers cannot take.

Usage::

    kaisa.checkpoint.save("ckpt/step100", model, optimizer, preconditioner)
    kaisa.checkpoint.load("ckpt/step100", model, optimizer, preconditioner)
"""

from __future__ import annotations

from kaisa.checkpoint.dcp import FORMAT, get_state_dict, kfac_state_dict, load, save
from kaisa.checkpoint.stateful import KFACStateful
from kaisa.core.checkpoint import KFACCheckpointable, KFACState

__all__ = ["FORMAT", "KFACCheckpointable", "KFACState", "KFACStateful", "get_state_dict",
           "kfac_state_dict", "load", "save"]
