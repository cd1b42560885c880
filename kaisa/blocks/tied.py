"""A weight tied between an ``nn.Embedding`` and an output ``nn.Linear`` head: one block.

The block is in the embedding's orientation (``docs/conventions.md``, "Parameters used
more than once"): the gradient matrix is ``W.grad^T`` (``E x V``), the A side is the
vocabulary ``V``, the G side the width ``E``. It is observed at two call sites, the
embedding's calls (site 0) and the head's (site 1), and keeps each use's batch factors
apart (:class:`UseStatistics`):

* the embedding's: ``A_e = diag(c) / M_e`` from the indices, ``G_e = D_e^T D_e / M_e`` from
  its output gradient;
* the head's: ``A_h = D_h^T D_h / M_h`` from its output gradient (the logits'),
  ``G_h = H^T H / M_h`` from its input.

They are averaged over micro-batches and ranks as stacks ``(uses, ...)``, then
:meth:`TiedEmbeddingBlock.combine` makes the block's batch factors, the pi-balanced sum
of the uses' factors, a Kronecker product with at least the curvature of
``sum_u w_u A_u (x) G_u`` in every direction (``w_u`` the uses' shares of the rows;
:func:`kaisa.blocks.kronecker.balanced_kronecker`). The vocabulary side is dense up to
:data:`~kaisa.blocks.state.LARGE_FACTOR_DIM` and diagonal above it (the head's ``A_h``
is then its diagonal). The head's bias is not tied and stays first-order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kaisa.blocks import factors
from kaisa.blocks.callsites import CallSite
from kaisa.blocks.embedding import EmbeddingBlock, select_indices
from kaisa.blocks.kronecker import balanced_kronecker
from kaisa.blocks.rows import flat_rows
from kaisa.blocks.state import LARGE_FACTOR_DIM, BatchStatistics, BlockOptions, tensor_bytes
from kaisa.utils.enums import KFACApprox, Side

__all__ = ["TiedEmbeddingBlock", "UseStatistics", "tied_heads"]

#: Call sites of a tied block.
EMBEDDING_SITE, HEAD_SITE = 0, 1


@dataclass
class UseStatistics(BatchStatistics):
    """Batch factors kept per use: ``(site, side) -> sum`` and how many were added.

    :meth:`take` returns each side as a stack over the uses that recorded (in site
    order) and leaves the uses' shares of the rows in :attr:`weights`.
    """

    sums: dict[tuple[int, Side], torch.Tensor] = field(default_factory=dict)
    counts: dict[tuple[int, Side], int] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)
    #: The row shares ``w_u`` of the last :meth:`take`, one per use in the stacks.
    weights: list[float] = field(default_factory=list)

    def add(self, site: int, side: Side, batch: torch.Tensor, rows: int = 0) -> None:
        """Adds one observation's batch factor of ``side`` at ``site`` (and its rows)."""
        key = (site, side)
        held = self.sums.get(key)
        self.sums[key] = batch if held is None else held.add_(batch)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.rows[site] = self.rows.get(site, 0) + rows

    @property
    def has_factors(self) -> bool:
        """Whether any use recorded a batch factor."""
        return bool(self.sums)

    def take(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-use mean batch factors, stacked, for the uses that recorded both sides."""
        sites = sorted({site for site, _ in self.sums})
        complete = [s for s in sites if (s, Side.A) in self.sums and (s, Side.G) in self.sums]
        stacks: list[torch.Tensor | None] = []
        for side in (Side.A, Side.G):  # each use's factor is (1, ...): one group
            means = [self.sums[(s, side)][0] / self.counts[(s, side)] for s in complete]
            stacks.append(torch.stack(means) if means else None)
        total = sum(self.rows.get(s, 0) for s in complete)
        self.weights = [self.rows.get(s, 0) / total if total else 1.0 / len(complete)
                        for s in complete]
        self.sums, self.counts, self.rows = {}, {}, {}
        return stacks[0], stacks[1]

    def nbytes(self) -> int:
        """Bytes held."""
        return super().nbytes() + tensor_bytes(*self.sums.values())

    def clear(self) -> None:
        """Forgets everything recorded."""
        self.saved_inputs.clear()
        self.saved_grads.clear()
        self.row_draws.clear()
        self.sums, self.counts, self.rows = {}, {}, {}


class TiedEmbeddingBlock(EmbeddingBlock):
    """An ``nn.Embedding`` and the ``nn.Linear`` head sharing its weight, as one block."""

    covers_tied = True

    def __init__(
        self,
        *,
        name: str,
        module: nn.Module,
        head: nn.Linear,
        factor_dtype: torch.dtype | None,
        kfac_approx: KFACApprox = KFACApprox.EXPAND,
        options: BlockOptions | None = None,
    ) -> None:
        self.head = head
        super().__init__(name=name, module=module, factor_dtype=factor_dtype,
                         kfac_approx=kfac_approx)
        self.uses = UseStatistics()
        self.stats = self.uses
        if options is not None:
            self.sample_rows(options)

    def setup(self) -> None:
        """The vocabulary side is dense up to ``LARGE_FACTOR_DIM``, diagonal above."""
        dense = self.dims[0] <= LARGE_FACTOR_DIM
        self.diagonal_sides = frozenset() if dense else frozenset({Side.A})

    def call_sites(self) -> tuple[CallSite, ...]:
        """The embedding's calls (site 0) and the head's (site 1)."""
        return (CallSite(self.module), CallSite(self.head))

    # ------------------------------------------------------------------ statistics
    def _vocabulary(self, batch: torch.Tensor) -> torch.Tensor:
        """A vocabulary-side batch factor in the block's layout (dense or diagonal)."""
        if self.is_diagonal(Side.A):
            return batch if batch.dim() == 2 else batch.diagonal(dim1=-2, dim2=-1)
        return batch if batch.dim() == 3 else torch.diag_embed(batch)

    def record_input(self, x: torch.Tensor, *, in_hook: bool, site: int = 0) -> None:
        """Indices (embedding: ``A_e``) or the head's input (``G_h = H^T H / M``).

        With :attr:`factor_rows`, of a subset drawn for the call (the use's row share
        counts every row).
        """
        if not in_hook:
            self.uses.saved_inputs.append((x, site))
            return
        m = x.numel() if site == EMBEDDING_SITE else x.numel() // x.shape[-1]
        rows = self.push_draw(site, m) if self.factor_rows is not None else None
        if site == EMBEDDING_SITE:
            a_e = self.compute_a_batch(select_indices(x, rows))
            self.uses.add(site, Side.A, self._vocabulary(a_e), m)
        else:
            g_h = factors.linear_a_factor(flat_rows(x, rows), bias=False, dtype=self.dtype_for(x))
            self.uses.add(site, Side.G, g_h, m)

    def record_output_grad(
        self, d: torch.Tensor, divisor: float | torch.Tensor, *, in_hook: bool,
        inputs: torch.Tensor | None, site: int = 0,
    ) -> None:
        """The embedding's output gradient (``G_e``) or the logits' (``A_h = D^T D / M``).

        With :attr:`factor_rows`, of the rows the call's forward drew.
        """
        if not in_hook:
            self.uses.saved_grads.append((d, divisor, site))
            return
        if self.factor_rows is not None:
            d = flat_rows(d, self.pop_draw(site))
        if site == EMBEDDING_SITE:
            self.uses.add(site, Side.G, self.compute_g_batch(d, divisor))
        elif self.is_diagonal(Side.A):
            rows = d.reshape(-1, d.shape[-1]).to(self.dtype_for(d))
            rows = rows / (divisor.to(rows.dtype) if isinstance(divisor, torch.Tensor)
                           else divisor)
            self.uses.add(site, Side.A, rows.square().mean(0, keepdim=True))
        else:
            self.uses.add(site, Side.A, self.compute_g_batch(d, divisor))

    def combine(
        self, a_batch: torch.Tensor | None, g_batch: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The pi-balanced sum of the uses' factors (``(1, ...)`` each)."""
        if a_batch is None or g_batch is None:
            return None, None
        uses = a_batch.shape[0]
        weights = self.uses.weights if len(self.uses.weights) == uses else [1.0 / uses] * uses
        x, y = balanced_kronecker(list(a_batch), list(g_batch), weights)
        return x.unsqueeze(0), y.unsqueeze(0)

    # ------------------------------------------------------------------ gradients
    def gradient_matrix(
        self, grads: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """``W.grad^T`` as ``(1, E, V)``; the ``padding_idx`` column is the head's gradient."""
        grad = self.weight.grad if grads is None else grads[0]
        return None if grad is None else grad.t().unsqueeze(0)


def tied_heads(model: nn.Module) -> dict[int, tuple[nn.Embedding, nn.Linear]]:
    """``id(weight) -> (embedding, head)`` for each embedding weight one Linear also holds.

    Only the exact pattern is a tied block: an ``nn.Embedding`` and exactly one other
    module using its weight, an ``nn.Linear`` whose ``weight`` it is (``V x E``).
    """
    users: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(module)
    pairs: dict[int, tuple[nn.Embedding, nn.Linear]] = {}
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            continue
        others = [m for m in users.get(id(module.weight), []) if m is not module]
        if len(others) == 1 and isinstance(others[0], nn.Linear) \
                and others[0].weight is module.weight:
            pairs[id(module.weight)] = (module, others[0])
    return pairs
