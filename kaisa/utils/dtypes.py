"""The one dtype rule of the numerics: work in float64 for float64, else in float32.

Factors, their accumulations and the decompositions all follow it: half-precision
activations and gradients are accumulated in float32, double precision stays double.
"""

from __future__ import annotations

import torch

__all__ = ["working_dtype"]


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """``torch.float64`` for ``torch.float64``, else ``torch.float32``.

    Args:
        dtype: The dtype of the data (activations, gradients, factors, ``inv_dtype``).

    Returns:
        The dtype to compute in.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32
