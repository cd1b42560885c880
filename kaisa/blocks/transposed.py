"""Linear layers whose weight is stored transposed, ``(in, out)``: ``y = x W + b``.

Hugging Face's ``transformers.pytorch_utils.Conv1D`` (every projection of GPT-2, GPT and
their descendants) is such a layer. kaisa recognises it without importing
``transformers``: a module whose class (or a base class) is named ``Conv1D``, with an
integer ``nf`` (output features) and a 2-D ``weight`` of ``nf`` columns. Its block is the
``nn.Linear`` block of the transposed weight (``docs/conventions.md``, "Transposed linear
layers"): the same factors, the gradient matrix ``[W.grad^T | b.grad]``, and the
preconditioned matrix written back transposed. Its kind is ``"linear"``: wherever
``layer_kinds`` covers ``nn.Linear``, it covers these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks.declared import Like, declared
from kaisa.blocks.linear import LinearBlock
from kaisa.utils.shards import is_sharded

__all__ = ["TransposedLinearBlock", "is_transposed_linear"]

#: The class names of transposed linear layers (Hugging Face's GPT-2 projections).
TRANSPOSED_CLASS_NAMES = frozenset({"Conv1D"})


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer with an ``(in, out)`` weight (HF ``Conv1D``)."""
    if not any(c.__name__ in TRANSPOSED_CLASS_NAMES for c in type(module).__mro__):
        return False
    weight, out = getattr(module, "weight", None), getattr(module, "nf", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and isinstance(out, int)
            and weight.shape[1] == out)


class TransposedLinearBlock(LinearBlock):
    """The ``nn.Linear`` block of a layer that stores its weight ``(in, out)``.

    ``A`` comes from the inputs and ``G`` from the output gradients exactly as for
    :class:`~kaisa.blocks.linear.LinearBlock` (``kfac_approx``, ``factor_rows`` and
    ``max_dense_dim`` included); only the weight's layout differs.
    """

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Module
    transposed: ClassVar[bool] = True

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """HF's ``Conv1D`` (:func:`is_transposed_linear`) or a class declared like it."""
        declaration = declared(module)
        if declaration is not None:
            return declaration.like is Like.TRANSPOSED_LINEAR
        return is_transposed_linear(module)

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """FSDP2 shards the weight by its input dimension: not a block there (yet)."""
        if is_sharded(getattr(module, "weight", None)):
            return ("FSDP2 shards this (in, out) weight by its input features; it is "
                    "first-order under FSDP2")
        return None

    @property
    def dims(self) -> tuple[int, int]:
        """``(in + bias, out)``."""
        rows, out = self.weight.shape
        return rows + int(self.has_bias), out

    def _out_rows(self) -> int:
        return int(self.weight.shape[1])

    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """``[W.grad^T | b.grad]`` as ``(1, out, in [+ 1])``."""
        if grads is None:
            grads = [p.grad for p in self.parameters()]
        weight_grad = grads[0]
        if weight_grad is None:
            return None
        return super().gradient_matrix([weight_grad.t(), *grads[1:]])

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """The weight's part transposed back to ``(in, out)`` (views), then the bias's."""
        rows, out = self.weight.shape
        mat = matrix.reshape(out, -1)
        if self.bias is None:
            return [mat.t()]
        return [mat[:, :rows].t(), mat[:, rows]]
