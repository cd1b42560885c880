"""Registered layers: a small registry of layer kinds.

Each kind is a :class:`~kaisa.layers.base.KFACLayer` subclass for one module type.
Adding a kind (Embedding, LayerNorm, ...) is one new module plus one entry in
:data:`LAYER_KINDS`.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from kaisa.layers.base import BatchStatistics, KFACLayer, RunningFactors
from kaisa.layers.conv2d import Conv2dLayer
from kaisa.layers.linear import LinearLayer

__all__ = [
    "LAYER_KINDS",
    "BatchStatistics",
    "Conv2dLayer",
    "KFACLayer",
    "LinearLayer",
    "RunningFactors",
    "register_layers",
]

#: Layer kinds, tried in order with ``isinstance``.
LAYER_KINDS: tuple[type[KFACLayer], ...] = (LinearLayer, Conv2dLayer)


def register_layers(
    model: nn.Module,
    *,
    skip: Sequence[re.Pattern[str]] = (),
    factor_dtype: torch.dtype | None = None,
) -> dict[str, KFACLayer]:
    """Wraps every supported, trainable module of ``model`` not matched by ``skip``.

    Args:
        model: The model.
        skip: Patterns matched with ``re.search`` against module names and class names.
        factor_dtype: Factor dtype of every layer (``None``: the activations', >= fp32).

    Returns:
        ``name -> layer`` in model order. Unsupported variants of a known module type
        are skipped with a warning that says why.
    """
    layers: dict[str, KFACLayer] = {}
    for name, module in model.named_modules():
        kind = next((k for k in LAYER_KINDS if isinstance(module, k.module_type)), None)
        if kind is None:
            continue
        cls_name = type(module).__name__
        if any(r.search(name) or r.search(cls_name) for r in skip):
            continue
        params = [p for p in (getattr(module, "weight", None), getattr(module, "bias", None))]
        if not all(p.requires_grad for p in params if isinstance(p, torch.Tensor)):
            continue
        reason = kind.supports(module)
        if reason is not None:
            warnings.warn(
                f"kaisa: not registering {name!r}: {reason}", RuntimeWarning, stacklevel=3
            )
            continue
        layers[name] = kind(name=name, module=module, factor_dtype=factor_dtype)
    return layers
