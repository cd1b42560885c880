"""Each example's part of a block's gradient, from one observed call of the block.

The curvature core's hooks (:mod:`kaisa.influence.observed`) hand every call of a block
(a module call, a functional product inside attention, a use of a tied weight) over as its
input ``x`` and output gradient ``d``; :func:`call_part` turns them into the examples'
parts of the block's gradient matrix ``(groups, rows, columns)``
(:meth:`kaisa.blocks.CurvatureBlock.gradient_matrix`):

* Kronecker rows (:class:`Rows`): ``a`` ``(N, groups, R, columns)`` and ``g``
  ``(N, groups, R, rows)``, each example's matrix ``g^T a`` summed over its ``R`` rows
  (a column of ones last in ``a`` when the block has a bias; ``unfold`` patches for a
  convolution; for the head of a tied weight, in the embedding's orientation, the
  logits' gradient is ``a`` and the head's input ``g``);
* an embedding's use (:class:`Indexed`): each row's output gradient added at its
  index's column;
* a norm's scale and shift (:class:`Elementwise`): each row's ``[xhat d; d]``.

Each part also gives every row's own term of a score (:meth:`Rows.per_row`): per-token
scores.

``docs/conventions.md``, "Influence", is the math.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa.blocks import Conv2dBlock, CurvatureBlock, EmbeddingBlock, LinearBlock
from kaisa.blocks.conv2d import Conv1dBlock
from kaisa.blocks.experts import ExpertBlock
from kaisa.blocks.scale_shift import ScaleShiftBlock
from kaisa.blocks.tied import HEAD_SITE, TiedEmbeddingBlock

__all__ = ["Elementwise", "Indexed", "Part", "Rows", "Unreached", "basis", "call_part",
           "evaluating", "example_dim", "row_kind", "running_factors", "scorable"]


@dataclass
class Rows:
    """Kronecker rows of the examples: their matrices are ``g^T a`` (summed over rows)."""

    a: torch.Tensor  # (N, groups, R, columns)
    g: torch.Tensor  # (N, groups, R, rows)

    def matrices(self) -> torch.Tensor:
        """``(N, groups, rows, columns)``."""
        return torch.einsum("nkro,nkri->nkoi", self.g, self.a)

    def per_row(self, p: torch.Tensor) -> torch.Tensor:
        """``<P_q, g_r a_r^T>`` of matrices ``p`` ``(Q, groups, rows, columns)``: ``(Q, N, R)``."""
        return torch.einsum("qkoi,nkri,nkro->qnr", p, self.a, self.g)

    def kept(self, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``(a, g)`` as matrices, without the masked positions' rows."""
        if mask is not None and self.a.shape[2] == mask.shape[1] and self.a.shape[1] == 1:
            keep = mask.to(torch.bool)
            return self.a[:, 0][keep], self.g[:, 0][keep]
        return self.a.flatten(0, 2), self.g.flatten(0, 2)


@dataclass
class Indexed:
    """An embedding's use: each row adds its output gradient at its index's column."""

    index: torch.Tensor  # (N, R) vocabulary indices
    g: torch.Tensor  # (N, R, E)
    vocabulary: int
    padding_idx: int | None

    def _kept(self) -> torch.Tensor:
        """``g`` with the padding rows zero (they give no gradient)."""
        if self.padding_idx is None:
            return self.g
        return self.g * (self.index != self.padding_idx).unsqueeze(-1).to(self.g.dtype)

    def matrices(self) -> torch.Tensor:
        """``(N, 1, E, V)``."""
        n, width = self.g.shape[0], self.g.shape[-1]
        cols = self.index.unsqueeze(1).expand(n, width, -1)
        out = self.g.new_zeros(n, width, self.vocabulary)
        return out.scatter_add_(2, cols, self._kept().mT).unsqueeze(1)

    def per_row(self, p: torch.Tensor) -> torch.Tensor:
        """``<P_q, g_r e_r^T>``: each row's gradient against its index's column of ``p``."""
        columns = p[:, 0][:, :, self.index]  # (Q, E, N, R)
        return torch.einsum("qenr,nre->qnr", columns, self._kept())


@dataclass
class Elementwise:
    """A norm's scale and shift: each row's gradient ``[xhat d; d]`` ``(N, R, P, E)``."""

    rows: torch.Tensor

    def matrices(self) -> torch.Tensor:
        """``(N, 1, P, E)``."""
        return self.rows.sum(1).unsqueeze(1)

    def per_row(self, p: torch.Tensor) -> torch.Tensor:
        """``<P_q, row>``: ``(Q, N, R)``."""
        return torch.einsum("nrpe,qpe->qnr", self.rows, p[:, 0])


@dataclass
class Unreached:
    """A block the pass did not reach: zero gradients ``(N, groups, rows, columns)``."""

    zeros: torch.Tensor

    def matrices(self) -> torch.Tensor:
        """The zeros."""
        return self.zeros

    def per_row(self, p: torch.Tensor) -> torch.Tensor:
        """Zero terms ``(Q, N, 1)`` (broadcast over any rows)."""
        return p.new_zeros(p.shape[0], self.zeros.shape[0], 1)


#: One call's part of the examples' gradient matrices.
Part = Rows | Indexed | Elementwise | Unreached


def scorable(block: CurvatureBlock) -> bool:
    """Whether influence has the examples' parts of the block's calls.

    Not an expert of a mixture-of-experts layer (its rows are the tokens routed to it,
    not the examples').
    """
    return not isinstance(block, ExpertBlock) and isinstance(
        block, LinearBlock | Conv2dBlock | EmbeddingBlock | ScaleShiftBlock)


def example_dim(block: CurvatureBlock) -> int:
    """The examples' dimension of a block's calls: 1 for attention's (sequence-first)."""
    return 1 if getattr(block, "_example_dim", 0) == 1 else 0


def row_kind(block: CurvatureBlock) -> bool:
    """The anchor's kinds: covariances ``(1/R) sum a a^T`` of the rows here.

    ``nn.Linear`` (and HF's transposed ``Conv1D``) observed at its module's calls, and a
    one-group ``nn.Conv2d`` with numeric padding; other kinds take the core's factors.
    """
    if any(site.weight is not None or site.module is not block.module
           for site in block.call_sites()):
        return False  # functional call sites (attention), or several modules
    if isinstance(block, Conv2dBlock):
        return (not isinstance(block, Conv1dBlock) and block.groups == 1
                and not isinstance(getattr(block.module, "padding", 0), str))
    return isinstance(block, LinearBlock) and (
        type(block).gradient_matrix is CurvatureBlock.gradient_matrix or block.transposed)


def call_part(block: CurvatureBlock, x: torch.Tensor, d: torch.Tensor, site: int,
              examples: int, dtype: torch.dtype, mask: torch.Tensor | None = None) -> Part:
    """The examples' part of ``block``'s gradient matrices from one call ``(x, d)``.

    With an attention ``mask`` ``(N, positions)``, a call whose rows are the positions
    has its masked rows' terms zero (their inputs, as Kronfluence masks activations).

    Raises:
        ValueError: The call's examples are not the batch's (``examples``).
    """
    part = _part(block, x, d, site, examples, dtype)
    if mask is not None and not isinstance(part, Unreached):
        weights = mask.to(dtype)
        if isinstance(part, Rows) and part.a.shape[2] == mask.shape[1]:
            part = Rows(a=part.a * weights[:, None, :, None], g=part.g)
        elif isinstance(part, Indexed) and part.g.shape[1] == mask.shape[1]:
            part = Indexed(index=part.index, g=part.g * weights[..., None],
                           vocabulary=part.vocabulary, padding_idx=part.padding_idx)
        elif isinstance(part, Elementwise) and part.rows.shape[1] == mask.shape[1]:
            part = Elementwise(rows=part.rows * weights[..., None, None])
    return part


def _part(block: CurvatureBlock, x: torch.Tensor, d: torch.Tensor, site: int,
          examples: int, dtype: torch.dtype) -> Part:
    first = example_dim(block)
    if x.shape[first] != examples:
        raise ValueError(
            f"influence: layer {block.name!r} is called on {x.shape[first]} rows, the batch "
            f"has {examples} examples (the examples must be dimension {first} of its input; "
            "a layer called once for the whole batch, like a position embedding, has no "
            "per-example gradient: leave it out with skip=)")
    x, d = x.movedim(first, 0), d.movedim(first, 0).to(dtype)
    if isinstance(block, TiedEmbeddingBlock) and site == HEAD_SITE:
        return Rows(a=_flat(d), g=_flat(x.to(dtype)))
    if isinstance(block, EmbeddingBlock):
        return _embedding(block, x, d)
    if isinstance(block, ScaleShiftBlock):
        return _scale_shift(block, x.to(dtype), d)
    if isinstance(block, Conv2dBlock):
        return _conv(block, x.to(dtype), d)
    a = _flat(x.to(dtype))
    if block.has_bias:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
    return Rows(a=a, g=_flat(d))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(N, ..., features)`` as ``(N, 1, R, features)``."""
    return t.reshape(t.shape[0], 1, -1, t.shape[-1])


def _conv(block: Conv2dBlock, x: torch.Tensor, d: torch.Tensor) -> Rows:
    """``unfold`` patches of the geometry, each group's channels apart."""
    if isinstance(block, Conv1dBlock):  # the Conv2d of height 1
        x, d = x.unsqueeze(2), d.unsqueeze(2)
    geo, n, groups = block.geometry, x.shape[0], block.groups
    patches = F.unfold(F.pad(x, geo.pad), geo.kernel_size, dilation=geo.dilation,
                       stride=geo.stride)  # (N, C k k, L)
    a = patches.reshape(n, groups, -1, patches.shape[-1]).mT  # (N, groups, L, C/g k k)
    if block.has_bias:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
    g = d.reshape(n, groups, d.shape[1] // groups, -1).mT  # (N, groups, L, out/g)
    return Rows(a=a, g=g)


def _embedding(block: EmbeddingBlock, index: torch.Tensor, d: torch.Tensor) -> Indexed:
    """Each row's output gradient at its index (the padding index gives none)."""
    n = index.shape[0]
    return Indexed(index=index.reshape(n, -1), g=d.reshape(n, -1, d.shape[-1]),
                   vocabulary=block.dims[0], padding_idx=block.padding_idx)


def _scale_shift(block: ScaleShiftBlock, x: torch.Tensor, d: torch.Tensor) -> Elementwise:
    """Each row's ``[xhat d; d]`` ``(N, R, P, E)``."""
    n, module = x.shape[0], block.module
    running = getattr(module, "running_mean", None)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and running is not None and not (
            module.training):  # evaluation: the running statistics
        rows = x.movedim(1, -1).reshape(-1, block.weight.numel())
        var = module.running_var
        assert var is not None
        xhat = (rows - running.to(rows.dtype)) * torch.rsqrt(var.to(rows.dtype) + module.eps)
    else:
        xhat = block.normalized(x)
    grads = block._grad_rows(d).reshape(n, -1, block.weight.numel())
    parts = [xhat.reshape(grads.shape) * grads]
    if block.has_bias:
        parts.append(grads)
    return Elementwise(rows=torch.stack(parts, dim=2))


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
