"""Curvature blocks: one :class:`~kaisa.blocks.base.CurvatureBlock` kind per layer kind.

Each kind is a subclass for one module type (or a few). Adding a kind (Embedding,
attention projections, ...) is one new module plus one entry in :data:`BLOCK_KINDS`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from kaisa.blocks.base import BatchStatistics, CurvatureBlock, KFACLayer, RunningFactors
from kaisa.blocks.conv2d import Conv1dBlock, Conv2dBlock
from kaisa.blocks.embedding import EmbeddingBlock
from kaisa.blocks.linear import LinearBlock
from kaisa.blocks.preconditioned import Preconditioned
from kaisa.blocks.scale_shift import ScaleShiftBlock
from kaisa.enums import KFACApprox

__all__ = [
    "BLOCK_KINDS",
    "BatchStatistics",
    "Conv1dBlock",
    "Conv2dBlock",
    "CurvatureBlock",
    "EmbeddingBlock",
    "KFACLayer",
    "LinearBlock",
    "Preconditioned",
    "RunningFactors",
    "ScaleShiftBlock",
    "register_blocks",
]

#: Block kinds, tried in order with ``isinstance``.
BLOCK_KINDS: tuple[type[CurvatureBlock], ...] = (
    LinearBlock, Conv2dBlock, Conv1dBlock, EmbeddingBlock, ScaleShiftBlock,
)


def register_blocks(
    model: nn.Module,
    *,
    skip: Sequence[re.Pattern[str]] = (),
    factor_dtype: torch.dtype | None = None,
    kfac_approx: KFACApprox = KFACApprox.EXPAND,
    kinds: Sequence[str] | None = None,
) -> dict[str, CurvatureBlock]:
    """Wraps every supported, trainable module of ``model`` not matched by ``skip``.

    Args:
        model: The model.
        skip: Patterns matched with ``re.search`` against module names and class names.
        factor_dtype: Factor dtype of every block (``None``: the activations', >= fp32).
        kfac_approx: Expand or reduce over the shared dimensions of sequence inputs.
        kinds: The kind names to register (``None``: every kind).

    Returns:
        ``name -> block`` in model order. Unsupported variants of a known module type
        are skipped with a warning that says why. A module of a kind that does not
        cover tied weights (:attr:`~CurvatureBlock.covers_tied`: embeddings) whose weight
        another module also holds is skipped: that module's block covers the weight, or,
        when none does, it is first-order with a warning.
    """
    users: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(name)
    tied: dict[str, tuple[int, list[str]]] = {}  # name -> (weight id, its other users)
    blocks: dict[str, CurvatureBlock] = {}
    for name, module in model.named_modules():
        kind = next((k for k in BLOCK_KINDS if isinstance(module, k.module_type)), None)
        if kind is None or (kinds is not None and kind.kind not in kinds):
            continue
        cls_name = type(module).__name__
        if any(r.search(name) or r.search(cls_name) for r in skip):
            continue
        params = [p for p in (getattr(module, "weight", None), getattr(module, "bias", None))]
        if not isinstance(params[0], torch.Tensor):
            continue  # no affine parameters (a norm with elementwise_affine=False)
        if not all(p.requires_grad for p in params if isinstance(p, torch.Tensor)):
            continue
        reason = kind.supports(module)
        if reason is not None:
            warnings.warn(
                f"kaisa: not registering {name!r}: {reason}", RuntimeWarning, stacklevel=3
            )
            continue
        others = [n for n in users.get(id(params[0]), []) if n != name]
        if others and not kind.covers_tied:
            tied[name] = (id(params[0]), others)
            continue
        blocks[name] = kind(name=name, module=module, factor_dtype=factor_dtype,
                            kfac_approx=kfac_approx)
    covered = {id(p) for block in blocks.values() for p in block.parameters()}
    for name, (weight, others) in tied.items():
        if weight not in covered:
            warnings.warn(
                f"kaisa: not registering {name!r}: its weight is tied to {others} (a tied "
                "weight is one block over every use, not defined for this kind yet); it is "
                "first-order", RuntimeWarning, stacklevel=3,
            )
    return blocks
