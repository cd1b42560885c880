"""Each example's gradient of every scored block, in the block's matrix layout.

One ``torch.func`` transform per batch (``vmap`` over the examples of ``grad`` of one
example's summed loss) gives every block kind its per-example gradient, however the
model uses the block (a module call, a functional call inside attention, a weight tied
between an embedding and a head, a norm's scale and shift); each block then turns its
parameters' gradients into its gradient matrix ``(groups, rows, columns)``
(:meth:`kaisa.blocks.CurvatureBlock.gradient_matrix`) under the same transform. The model
runs in evaluation mode; its parameters' ``.grad`` are not touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from kaisa.blocks import CurvatureBlock
from kaisa.influence.rows import evaluating

__all__ = ["example_gradients"]


def example_gradients(
    model: nn.Module, blocks: Mapping[str, CurvatureBlock], inputs: torch.Tensor,
    targets: torch.Tensor, value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """``{block name: (N, groups, rows, columns)}``: the examples' gradients of ``value``.

    ``value(outputs, targets)`` is called on one example at a time, as a batch of one
    (``inputs[n:n+1]``, ``targets[n:n+1]``), and must return that example's scalar.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: one name
    wanted: dict[str, torch.Tensor] = {}
    for block in blocks.values():
        for p in block.parameters():
            wanted.setdefault(names[id(p)], p.detach())

    def one(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
            ) -> torch.Tensor:
        return value(functional_call(model, weights, (x.unsqueeze(0),)), y.unsqueeze(0))

    def matrices(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, block in blocks.items():
            matrix = block.gradient_matrix([grads[names[id(p)]] for p in block.parameters()])
            assert matrix is not None
            out[name] = matrix.to(dtype)
        return out

    def per_example(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
                    ) -> dict[str, torch.Tensor]:
        return matrices(grad(one)(weights, x, y))

    with torch.no_grad(), evaluating(model), warnings.catch_warnings():
        # grad() differentiates inside no_grad; an op without a batching rule (CPU flash
        # attention) runs example by example, with the same results
        warnings.filterwarnings("ignore", message="There is a performance drop because")
        result: Any = vmap(per_example, in_dims=(None, 0, 0))(wanted, inputs, targets)
    return dict(result)
