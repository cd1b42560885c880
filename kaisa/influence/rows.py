"""What influence reads of a block: its rows ``(a, g)``, observed at its module's calls.

``a`` is a row of the block's input (a column of ones appended last when the block has a
bias; ``unfold`` patches for a convolution) and ``g`` the gradient of the loss with respect
to the block's output at that row, both per example: ``(N, rows, in [+1])`` and
``(N, rows, out)`` (``docs/conventions.md``, "Influence").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from kaisa.blocks import Conv2dBlock, CurvatureBlock, LinearBlock
from kaisa.blocks.conv2d import Conv1dBlock

__all__ = ["basis", "evaluating", "example_rows", "observe", "row_kind", "running_factors"]


def row_kind(block: CurvatureBlock) -> bool:
    """The anchor's kinds, observed at their module's own calls: rows here.

    ``nn.Linear`` (and HF's transposed ``Conv1D``) and a one-group ``nn.Conv2d`` with
    numeric padding; their covariances are the conventions' ``(1/R) sum a a^T``.
    """
    if any(site.weight is not None or site.module is not block.module
           for site in block.call_sites()):
        return False  # functional call sites (attention, experts), or several modules
    if isinstance(block, Conv2dBlock):
        conv = block.module
        return (not isinstance(block, Conv1dBlock) and block.groups == 1
                and not isinstance(getattr(conv, "padding", 0), str))  # 'same', 'valid': later
    return isinstance(block, LinearBlock) and (
        type(block).gradient_matrix is CurvatureBlock.gradient_matrix or block.transposed)


def example_rows(block: CurvatureBlock, x: torch.Tensor, d: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, g)`` as ``(N, rows, in [+1])`` and ``(N, rows, out)``: each example's rows."""
    n = x.shape[0]
    if isinstance(block, Conv2dBlock):
        conv = block.module
        assert isinstance(conv, nn.Conv2d)
        a = F.unfold(x.to(dtype), conv.kernel_size, dilation=conv.dilation,
                     padding=conv.padding, stride=conv.stride).transpose(1, 2)  # type: ignore[arg-type]
        g = d.to(dtype).reshape(n, d.shape[1], -1).transpose(1, 2)
    else:
        a = x.to(dtype).reshape(n, -1, x.shape[-1])
        g = d.to(dtype).reshape(n, -1, d.shape[-1])
    if block.has_bias:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
    return a, g


@contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in evaluation mode for the block (every module's own mode restored)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def observe(model: nn.Module, blocks: Mapping[str, CurvatureBlock], inputs: torch.Tensor,
            value: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
            also: Sequence[torch.Tensor] = (),
            ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per block, the ``(a, g)`` rows of one batch under ``value(outputs)``.

    The calls of a block side by side, in evaluation mode; the parameters' ``.grad`` are not
    touched. The backward pass also reaches ``also`` (parameters whose other hooks record
    in the same pass).
    """
    calls: dict[str, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {n: [] for n in blocks}
    handles = []
    for name, block in blocks.items():
        def hook(module: nn.Module, args: Any, out: Any, name: str = name) -> None:
            if isinstance(out, torch.Tensor) and out.requires_grad and args:
                if args[0].shape[0] != inputs.shape[0]:
                    raise ValueError(
                        f"influence: layer {name!r} is called on {args[0].shape[0]} rows, the "
                        f"batch has {inputs.shape[0]} examples (dimension 0 of every layer's "
                        "input must be the examples)")
                # the output's gradient edge: the gradient where the layer made it, even if
                # the model then changes the output in place
                calls[name].append((args[0].detach(), out, get_gradient_edge(out)))

        handles.append(block.module.register_forward_hook(hook))
    try:
        with torch.enable_grad(), evaluating(model):
            loss = value(model(inputs))
    finally:
        for handle in handles:
            handle.remove()
    seen = [(n, x, out, edge) for n, observed in calls.items() for x, out, edge in observed]
    wanted = [edge for *_, edge in seen] + list(also)
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)[:len(seen)]
    rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n in blocks}
    for (name, x, out, _), d in zip(seen, grads, strict=True):
        rows[name].append(example_rows(blocks[name], x,
                                       torch.zeros_like(out) if d is None else d, dtype))
    return {name: (torch.cat([a for a, _ in r], dim=1), torch.cat([g for _, g in r], dim=1))
            for name, r in rows.items() if r}


def running_factors(product: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{block name: (A, G)}``: a product's running factors, to seed a fit's bases.

    ``product`` is a ``KFACPreconditioner``, ``kaisa.KFAC``, ``kaisa.EKFAC`` or
    ``kaisa.KFACMuon`` (anything with ``curvature.blocks``) of the same model. Each factor
    as the block shows it (``a_factor``, ``g_factor``): ``(n, n)``, ``(groups, n, n)``
    for grouped convolutions, a diagonal side as its diagonal (whose basis is the
    identity's); blocks without both factors (diagonal kinds, none yet) are left out.
    """
    out = {}
    for name, block in product.curvature.blocks.items():
        a, g = block.a_factor, block.g_factor
        if a is not None and g is not None and not block.diagonal:
            out[name] = (a, g)
    return out


def basis(factor: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of the symmetrised ``factor`` (or a stack), float64, ascending."""
    f = factor.double()
    vectors: torch.Tensor = torch.linalg.eigh((f + f.mT) / 2).eigenvectors
    return vectors
