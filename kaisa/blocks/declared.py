"""Module classes kaisa treats as a known layer: the models users bring.

Block kinds recognise torch's modules by type. Libraries define their own classes for the
same maths: Hugging Face's ``Conv1D`` (a transposed linear layer) and its RMS norms
(``LlamaRMSNorm``, ``Qwen3RMSNorm``, ``T5LayerNorm``, ...). Those are recognised by name
and layout (:func:`hf_rms_norm`, :func:`kaisa.blocks.transposed.is_transposed_linear`),
without importing the library. Any other class is declared once with
:func:`declare_module`: it then makes the block of the layer it is declared like.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Like", "declare_module", "declared", "hf_rms_norm", "norm_eps"]


class Like(str, enum.Enum):
    """The layer a declared module class computes (on its first positional input)."""

    #: ``y = x W^T + b``, ``weight`` ``(out, in)``, optional ``bias`` (``nn.Linear``).
    LINEAR = "linear"
    #: ``y = x W + b``, ``weight`` ``(in, out)``, optional ``bias`` (HF ``Conv1D``).
    TRANSPOSED_LINEAR = "transposed_linear"
    #: ``y = weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (``nn.RMSNorm``).
    RMS_NORM = "rms_norm"
    #: ``y = weight * (x - mean) / sqrt(var + eps) + bias`` over the last dimension
    #: (``nn.LayerNorm``).
    LAYER_NORM = "layer_norm"


@dataclass(frozen=True)
class Declaration:
    """What a declared class computes, and the attribute holding its ``eps`` (norms)."""

    like: Like
    eps: str = "eps"


_DECLARED: dict[type[nn.Module], Declaration] = {}


def declare_module(cls: type[nn.Module], *, like: Like | str, eps: str = "eps") -> None:
    """Makes kaisa treat ``cls`` (and its subclasses) as the layer ``like``.

    Declare before constructing the optimizer or preconditioner. The module must hold
    the parameters that layer holds (``weight``, and ``bias`` if any) and compute it on
    its first positional argument, returning one tensor; its ``layer_kinds`` kind is that
    layer's (``"linear"`` for both linear layouts, ``"scale_shift"`` for both norms).

    Args:
        cls: The module class.
        like: ``'linear'``, ``'transposed_linear'``, ``'rms_norm'`` or ``'layer_norm'``.
        eps: For the norms, the name of the attribute that holds their epsilon.

    Raises:
        TypeError: ``cls`` is not an ``nn.Module`` subclass.
        ValueError: ``like`` is not one of the above.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"declare_module needs an nn.Module subclass, got {cls!r}")
    try:
        kind = Like(like)
    except ValueError:
        raise ValueError(f"like must be one of {[k.value for k in Like]}, got {like!r}") from None
    _DECLARED[cls] = Declaration(kind, eps)


def declared(module: nn.Module) -> Declaration | None:
    """The declaration of ``module``'s class or its nearest declared base class."""
    for cls in type(module).__mro__:
        found = _DECLARED.get(cls)
        if found is not None:
            return found
    return None


def hf_rms_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a weight-only RMS norm of Hugging Face's naming.

    A class named ``*RMSNorm`` or ``T5LayerNorm`` (not torch's own), whose only parameter
    is a 1-D ``weight`` and that keeps its epsilon in ``variance_epsilon`` or ``eps``.
    Gemma's ``(1 + weight)`` scaling has the same statistics (the output's derivative by
    ``weight`` is the normalised input either way).
    """
    if isinstance(module, nn.RMSNorm):
        return False
    name = type(module).__name__
    if not (name.endswith("RMSNorm") or name == "T5LayerNorm"):
        return False
    weight = getattr(module, "weight", None)
    params = list(module.parameters(recurse=False))
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and len(params) == 1
            and _eps_attribute(module) is not None)


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon of a declared or Hugging Face norm (``None`` where it has none)."""
    declaration = declared(module)
    name = declaration.eps if declaration is not None else _eps_attribute(module)
    value = None if name is None else getattr(module, name, None)
    return float(value) if isinstance(value, (int, float)) else None


def _eps_attribute(module: nn.Module) -> str | None:
    for name in ("variance_epsilon", "eps"):
        if isinstance(getattr(module, name, None), (int, float)):
            return name
    return None
