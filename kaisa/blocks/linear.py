"""``nn.Linear`` layers (any number of leading input dimensions)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from kaisa.blocks import factors
from kaisa.blocks.base import CurvatureBlock
from kaisa.blocks.declared import Like, declared
from kaisa.blocks.rows import RowSampling, flat_rows, sampling
from kaisa.blocks.state import BlockOptions, RunningFactors
from kaisa.utils.enums import KFACApprox, Side

__all__ = ["LinearBlock"]


class LinearBlock(RowSampling):
    """An ``nn.Linear``: ``A = Xb^T Xb / M``, ``G = D^T D / M``.

    The first input dimension is the batch (``N``), every other leading dimension is
    shared by the weight. ``kfac_approx='expand'`` makes every position a row
    (``M = N R``); ``'reduce'`` makes one row per example from the inputs' mean and the
    output gradients' sum over the shared dimensions (``M = N``; equal to expand when
    there is no shared dimension).

    With :attr:`factor_rows` ``= k`` (set by :meth:`build` from
    :attr:`BlockOptions.factor_rows`; attention blocks too), a call with more than ``k``
    rows uses ``k`` of them drawn at random, the same for its ``A`` and its ``G``
    (``docs/conventions.md``, "Row-subsampled factor statistics").
    """

    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = nn.Linear
    kind = "linear"

    @classmethod
    def matches(cls, module: nn.Module) -> bool:
        """An ``nn.Linear``, or a class declared like one (a declaration decides)."""
        declaration = declared(module)
        if declaration is not None:
            return cls is LinearBlock and declaration.like is Like.LINEAR
        return super().matches(module)

    @classmethod
    def build(
        cls, name: str, module: nn.Module, options: BlockOptions
    ) -> dict[str, CurvatureBlock]:
        """One block named ``name``, subsampling with ``options.factor_rows``."""
        return cls.configured(super().build(name, module, options), options)

    @staticmethod
    def configured(made: dict[str, CurvatureBlock], options: BlockOptions
                   ) -> dict[str, CurvatureBlock]:
        """``made`` subsampling with ``options.factor_rows``, dense up to ``max_dense_dim``."""
        made = sampling(made, options)
        for block in made.values():
            if isinstance(block, LinearBlock):
                block.limit_dense(options.max_dense_dim)
        return made

    def limit_dense(self, limit: int | None) -> None:
        """Keeps each side larger than ``limit`` as its diagonal (``None``: no change).

        Called before any statistics (``docs/conventions.md``, "One-sided bases").
        """
        if limit is None:
            return
        sides = frozenset(side for side, n in zip((Side.A, Side.G), self.dims, strict=True)
                          if n > limit)
        if sides != self.diagonal_sides:
            self.diagonal_sides = sides
            self.factors = RunningFactors(diagonal_sides=sides)

    def compute_a_batch(self, x: torch.Tensor) -> torch.Tensor:
        """``Xb^T Xb / M`` (rows: positions, or examples' mean inputs)."""
        dtype = self.dtype_for(x)
        if self._reduces(x):
            x = x.to(dtype).mean(dim=self._shared_dims(x))
        if self.is_diagonal(Side.A):
            return factors.linear_a_diagonal(x, bias=self.has_bias, dtype=dtype)
        return factors.linear_a_factor(x, bias=self.has_bias, dtype=dtype)

    def compute_g_batch(
        self, grad_output: torch.Tensor, loss_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``D^T D / M`` (rows: positions, or examples' summed output gradients)."""
        dtype = self.dtype_for(grad_output)
        if self._reduces(grad_output):
            grad_output = grad_output.to(dtype).sum(dim=self._shared_dims(grad_output))
        if self.is_diagonal(Side.G):
            return factors.linear_g_diagonal(grad_output, dtype=dtype, loss_scale=loss_scale)
        return factors.linear_g_factor(grad_output, dtype=dtype, loss_scale=loss_scale)

    # ------------------------------------------------------------------ row subsets
    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        """The batch A factor of ``x``, of a drawn row subset with :attr:`factor_rows`.

        The subset (``None`` when the call has at most ``factor_rows`` rows) is kept for
        the call's output gradient (:meth:`record_output_grad`), per call site.
        """
        if self.factor_rows is None or not in_hook:
            super().record_input(x, in_hook=in_hook, site=site)
            return
        rows = self.push_draw(site, self.row_count(x))
        self.stats.add_a(self.compute_a_batch(self.select_rows(x, rows)))

    def gradient_rows(self, d: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The rows ``rows`` of output gradient ``d`` under ``kfac_approx``."""
        return self.select_rows(d, rows)

    def row_count(self, t: torch.Tensor) -> int:
        """``M``: the rows of ``t`` (an input or an output gradient) under ``kfac_approx``."""
        if self._reduces(t):
            return int(t.shape[self._example_dim])
        return math.prod(t.shape[:-1])

    def select_rows(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The rows ``rows`` of ``t`` (``t`` itself for ``None``), on ``t``'s device.

        Examples (the first dimension; an attention block's second) under ``'reduce'``,
        else positions: ``(k, features)``.
        """
        if rows is not None and self._reduces(t):
            return t.index_select(self._example_dim, rows.to(t.device))
        return flat_rows(t, rows)

    #: The examples' dimension of an observation (``'reduce'`` keeps one row per example).
    _example_dim = 0

    def _reduces(self, t: torch.Tensor) -> bool:
        return self.kfac_approx is KFACApprox.REDUCE and t.dim() > 2

    def _shared_dims(self, t: torch.Tensor) -> tuple[int, ...]:
        """The dimensions ``'reduce'`` averages (sums) over: all but the batch's (first)."""
        return tuple(range(1, t.dim() - 1))
