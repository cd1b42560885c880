"""Row-subsampled factor statistics (``factor_rows``): the draws a block's calls share.

``docs/conventions.md``, "Row-subsampled factor statistics": a call with more than
``factor_rows`` rows computes both its factors from ``factor_rows`` of them, drawn when its
forward pass reaches it (the first ``k`` of a ``randperm`` of the product's CPU generator)
and used again by its output gradient. :class:`RowSampling` is the mixin the subsampled
kinds (Linear, attention, embedding, tied embedding) share: the draw, the per-site stack
of draws that pairs a forward call with its backward (last drawn, first used), and the
row selection.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from kaisa.blocks.base import CurvatureBlock
from kaisa.blocks.state import BatchStatistics, BlockOptions

__all__ = ["RowSampling", "flat_rows", "sampling"]

T = TypeVar("T")


class RowSampling(CurvatureBlock):
    """Draws and pairs row subsets for a block with :attr:`factor_rows` set."""

    #: Rows kept per call (``None``: every row).
    factor_rows: int | None = None
    #: The CPU generator the row subsets are drawn from (with :attr:`factor_rows`).
    row_generator: torch.Generator | None = None
    #: The block's per-step statistics (where the pending draws are kept).
    stats: BatchStatistics

    def sample_rows(self, options: BlockOptions) -> None:
        """Subsamples with ``options.factor_rows`` (when set) from its ``row_generator``.

        Raises:
            ValueError: If ``factor_rows`` is set without a generator.
        """
        if options.factor_rows is None:
            return
        if options.row_generator is None:
            raise ValueError("factor_rows needs a row_generator to draw the rows from")
        self.factor_rows = options.factor_rows
        self.row_generator = options.row_generator

    def record_output_grad(
        self, d: torch.Tensor, divisor: float | torch.Tensor, *, in_hook: bool,
        inputs: torch.Tensor | None, site: int = 0,
    ) -> None:
        """The batch G factor of ``d``, of the rows its forward call drew (last drawn first)."""
        if self.factor_rows is None or not in_hook:
            super().record_output_grad(d, divisor, in_hook=in_hook, inputs=inputs, site=site)
            return
        rows = self.pop_draw(site)  # unpaired (cleared mid-step): every row
        self.stats.add_g(self.compute_g_batch(self.gradient_rows(d, rows), divisor))

    def gradient_rows(self, d: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The rows ``rows`` of output gradient ``d`` (flattened to rows; ``None``: all)."""
        return flat_rows(d, rows)

    def draw_rows(self, m: int) -> torch.Tensor | None:
        """``S``: the first ``factor_rows`` of a random permutation of ``m`` rows (CPU).

        ``None`` (every row; the generator is not advanced) when ``m <= factor_rows``.
        """
        k = self.factor_rows
        if k is None or m <= k:
            return None
        return torch.randperm(m, generator=self.row_generator)[:k]

    def push_draw(self, site: int, m: int) -> torch.Tensor | None:
        """Draws a forward call's subset of ``m`` rows and keeps it for its backward."""
        rows = self.draw_rows(m)
        self.stats.row_draws.setdefault(site, []).append(rows)
        return rows

    def pop_draw(self, site: int) -> torch.Tensor | None:
        """The subset of the call whose output gradient arrives (the last drawn at ``site``).

        ``None`` (every row) when none is pending (the draws were cleared mid-step).
        """
        draws = self.stats.row_draws.get(site)
        return draws.pop() if draws else None


def sampling(made: dict[str, T], options: BlockOptions) -> dict[str, T]:
    """``made`` (a kind's new blocks), each subsampling with ``options.factor_rows``."""
    for block in made.values():
        if isinstance(block, RowSampling):
            block.sample_rows(options)
    return made


def flat_rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows ``rows`` of ``t`` read as ``(M, features)`` (``t`` itself for ``None``)."""
    if rows is None:
        return t
    return t.reshape(-1, t.shape[-1]).index_select(0, rows.to(t.device))
