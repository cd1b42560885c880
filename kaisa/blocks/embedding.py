"""``nn.Embedding`` layers: the Linear rule on one-hot inputs, with a diagonal A factor.

With ``W`` (``V x E``) read as the Linear weight ``W^T`` (out ``E``, in ``V``, no bias),
the one-hot rows of the looked-up indices give ``A = diag(c) / M`` (``c_v`` how many of the
``M`` positions are token ``v``): a diagonal factor, kept as its diagonal ``(1, V)``
(:attr:`~kaisa.blocks.CurvatureBlock.diagonal_sides`), and ``G = D^T D / M`` from the
output gradient's ``(M, E)`` rows. The gradient matrix is ``W.grad^T``, its
``padding_idx`` column set to zero (``docs/conventions.md``, "Embedding blocks").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks import factors
from kaisa.blocks.base import CurvatureBlock
from kaisa.blocks.rows import RowSampling, sampling
from kaisa.blocks.state import BlockOptions
from kaisa.utils.dtypes import working_dtype
from kaisa.utils.enums import Side

__all__ = ["EmbeddingBlock", "select_indices"]


class EmbeddingBlock(RowSampling):
    """An ``nn.Embedding``: ``A = diag(c) / M`` (as its diagonal), ``G = D^T D / M``.

    Every looked-up position is a row (``kfac_approx`` does not apply: a per-example
    reduction of one-hot rows would make ``A`` dense). With :attr:`factor_rows` ``= k``
    a call with more than ``k`` indices uses ``k`` of them drawn at random for both
    factors (``docs/conventions.md``, "Row-subsampled factor statistics").
    """

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Embedding
    kind = "embedding"
    diagonal_sides = frozenset({Side.A})
    covers_tied = False

    @classmethod
    def supports(cls, module: nn.Module) -> str | None:
        """``max_norm``, ``scale_grad_by_freq`` and ``sparse`` embeddings are not blocks."""
        assert isinstance(module, nn.Embedding)
        if module.max_norm is not None:
            return ("max_norm renormalises the looked-up rows of the weight in the forward "
                    "pass (first-order)")
        if module.scale_grad_by_freq:
            return ("scale_grad_by_freq rescales the gradient by inverse token frequencies, "
                    "which is not the loss's gradient (first-order)")
        if module.sparse:
            return "sparse=True gives sparse gradients; a dense direction would replace them " \
                   "(first-order)"
        return None

    @classmethod
    def build(
        cls, name: str, module: nn.Module, options: BlockOptions
    ) -> dict[str, CurvatureBlock]:
        """One block named ``name``, subsampling with ``options.factor_rows``."""
        return sampling(super().build(name, module, options), options)

    @property
    def dims(self) -> tuple[int, int]:
        """``(V, E)``: the vocabulary (A, diagonal) and the embedding width (G)."""
        vocabulary, width = self.weight.shape
        return int(vocabulary), int(width)

    @property
    def padding_idx(self) -> int | None:
        """The row that stays zero, if any."""
        assert isinstance(self.module, nn.Embedding)
        return self.module.padding_idx

    # ------------------------------------------------------------------ statistics
    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``c / M`` as ``(1, V)`` from the indices ``x`` (any shape), in the weight's dtype."""
        dtype = self.factor_dtype or working_dtype(self.weight.dtype)
        # exact integer counts, a static shape (no graph break under torch.compile, unlike
        # bincount) and deterministic on CUDA
        idx = x.reshape(-1).long()
        counts = torch.zeros(self.dims[0], dtype=torch.int64, device=x.device)
        counts.index_add_(0, idx, torch.ones_like(idx))
        return (counts.to(dtype) / max(x.numel(), 1)).unsqueeze(0)

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``D^T D / M`` of the output gradient's ``(M, E)`` rows."""
        return factors.linear_g_factor(
            grad_output, dtype=self.dtype_for(grad_output), loss_scale=loss_scale
        )

    # ------------------------------------------------------------------ row subsets
    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        """The batch A factor of the indices ``x``, of a drawn subset with :attr:`factor_rows`."""
        if self.factor_rows is None or not in_hook:
            super().record_input(x, in_hook=in_hook, site=site)
            return
        rows = self.push_draw(site, x.numel())
        self.stats.add_a(self.compute_a_batch(select_indices(x, rows)))

    # ------------------------------------------------------------------ gradients
    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """``W.grad^T`` as ``(1, E, V)``, the ``padding_idx`` column zero."""
        grad = self.weight.grad if grads is None else grads[0]
        if grad is None:
            return None
        matrix = grad.t()
        if self.padding_idx is not None:
            matrix = matrix.clone()  # never the caller's gradient
            matrix[:, self.padding_idx] = 0
        return matrix.unsqueeze(0)

    def split(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """``[matrix^T]`` in the weight's layout (a view)."""
        return [matrix.reshape(self.weight.shape[1], -1).t()]


def select_indices(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The indices ``rows`` of ``x`` flattened (``x`` itself for ``None``)."""
    return x if rows is None else x.reshape(-1).index_select(0, rows.to(x.device))
