"""EK-FAC influence scores on kaisa's blocks (``docs/conventions.md``, "Influence").

:class:`EKFACInfluence` fits, over a training set read in order, each block's covariances
``A`` and ``S`` (the factor pass, with the Fisher's labels), their eigenbases, and the
corrected eigenvalues ``Λ`` from per-example gradients (a second pass with fresh labels),
then computes pairwise scores (queries x training examples) and self-influence scores.
The blocks are kaisa's (:func:`kaisa.blocks.register_blocks`), every kind: the anchor's
(``nn.Linear``, Hugging Face's transposed ``Conv1D``, ``nn.Conv2d``) from their rows
(:mod:`kaisa.influence.rows`), the others (attention, embeddings, a tied embedding and
head, convolutions of other shapes) from the core's statistics
(:mod:`kaisa.influence.recorded`), diagonal kinds (norms) with identity bases; every
kind's per-example gradients come from :mod:`kaisa.influence.gradients`.

Under ``torch.distributed`` each rank passes its own contiguous shard of the training set
(rank 0 the first): the sums and counts of both passes are summed over the ranks (every
rank then holds the same fit), and the scores of each rank's shard are gathered, in rank
order, on every rank (kaisa's communicator, :mod:`kaisa.distributed`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa import ops
from kaisa.blocks import register_blocks
from kaisa.core.coverage import FIRST_ORDER
from kaisa.distributed.strategy import FractionSpec
from kaisa.influence.fit import (
    BlockFit,
    decompose,
    dense_sides,
    matrix_shape,
    seeded,
    summed_sides,
)
from kaisa.influence.observed import Inputs, Observer, Pass
from kaisa.influence.ranks import Ranks
from kaisa.influence.results import fit_file, read
from kaisa.influence.rows import Part, Rows, Unreached, call_part, row_kind, scorable
from kaisa.influence.scores import Queries, check_rank, query_shape, summed, token_terms
from kaisa.utils.enums import DistributedStrategy

__all__ = ["EKFACInfluence", "Fisher"]

#: A batch: ``(inputs, targets)``; the model is called on ``inputs`` (a tensor), or on
#: ``**inputs`` (keyword tensors: an ``attention_mask`` masks the positions).
Batch = tuple[Inputs, torch.Tensor]
#: ``(outputs, targets) -> summed scalar`` (a query's measurement).
Measurement = Callable[[Any, torch.Tensor], torch.Tensor]

#: Targets equal to this are padding: no loss, and no Fisher label is drawn for them.
IGNORE_INDEX = -100
#: The heuristic damping's scale of ``mean(Λ)`` (Kronfluence's).
HEURISTIC_DAMPING = 0.1


class Fisher(str, enum.Enum):
    """Whose labels the factors are fitted with."""

    #: Labels drawn from the model's predictive distribution (the true Fisher).
    TRUE = "true"
    #: The batches' own targets (the empirical Fisher).
    EMPIRICAL = "empirical"


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model's outputs: the tensor, or its ``logits`` (Hugging Face)."""
    logits = getattr(outputs, "logits", outputs)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model's outputs are a {type(outputs).__name__} without logits; "
                        "pass loss= to read them")
    return logits


def summed_cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over every position (no ``1/B``); ``-100`` is ignored."""
    logits = logits_of(outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum")


class EKFACInfluence:
    """EK-FAC influence: fit once on the training set, then score queries.

    Args:
        model: The trained model (its mode is restored after each pass; the passes run it
            in evaluation mode); a DDP-wrapped model is read through its ``module``.
        fisher: ``'true'`` (labels drawn from the model, with ``seed``) or
            ``'empirical'`` (the batches' targets).
        damping: Added to ``Λ`` at score time: a number, or ``None`` for
            ``0.1 mean(Λ)`` per block.
        seed: Seed of the generator the true Fisher's labels are drawn with.
        dtype: Dtype of the statistics and scores (eigendecompositions run in float64).
        layer_kinds: Block kinds to track (``"linear"``, ``"conv2d"``, ``"conv1d"``,
            ``"attention"``, ``"embedding"``, ``"scale_shift"``), or ``"all"``.
        skip: Patterns (``re.search``) of module, class or block names not to score
            (e.g. a position embedding called once for the whole batch).
        masked: Patterns of the layers a batch's ``attention_mask`` applies to (``None``:
            every layer whose calls' rows are the mask's positions; name the encoder's
            where a decoder's sequence may have the same length).
        loss: ``(outputs, targets) -> summed loss`` of a batch; the summed cross-entropy
            by default (the true Fisher draws classification labels for it).
        progress: Show a progress bar for each pass over batches (needs ``tqdm``).
        grad_worker_fraction: KAISA's strategy under ``torch.distributed``
            (``'comm_opt'``, ``'mem_opt'``, ``'hybrid_opt'`` or a fraction): where each
            block's eigendecompositions are computed and its queries preconditioned
            (:mod:`kaisa.influence.ranks`); the scores do not depend on it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        fisher: Fisher | str = Fisher.TRUE,
        damping: float | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        layer_kinds: str | tuple[str, ...] = "all",
        skip: Sequence[str] = (),
        masked: Sequence[str] | None = None,
        loss: Measurement = summed_cross_entropy,
        progress: bool = False,
        grad_worker_fraction: FractionSpec = DistributedStrategy.COMM_OPT,
    ) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module  # its gradient synchronisation has no part here
        self.model = model
        self.fisher = Fisher(fisher)
        if damping is not None and not damping >= 0:
            raise ValueError(f"damping must be >= 0 or None, got {damping!r}")
        self.damping = damping
        self.dtype = dtype
        self.loss = loss
        self._device = next(model.parameters()).device
        kinds = None if layer_kinds == "all" else (
            (layer_kinds,) if isinstance(layer_kinds, str) else tuple(layer_kinds))
        blocks = register_blocks(model, kinds=kinds, factor_dtype=dtype,
                                 skip=[re.compile(p) for p in skip])
        self.blocks = {name: b for name, b in blocks.items() if scorable(b)}
        if not self.blocks:
            raise ValueError(f"model has no layer influence can track (kinds {layer_kinds!r})")
        self._factors = {name: BlockFit() for name in self.blocks}
        self._observer = Observer(
            model, self.blocks, progress=progress, masked=None if masked is None else {
                n for n in self.blocks if any(re.search(p, n) for p in masked)})
        self._ranks = Ranks(self.blocks, {n: dense_sides(b) for n, b in self.blocks.items()},
                            grad_worker_fraction)
        self.generator = torch.Generator().manual_seed(seed + self._ranks.rank)
        covered = {id(p): b.kind for b in self.blocks.values() for p in b.parameters()}
        self._coverage = {n: covered.get(id(p), FIRST_ORDER)
                          for n, p in model.named_parameters() if p.requires_grad}

    # ------------------------------------------------------------------ fitting
    def coverage(self) -> dict[str, str]:
        """``{parameter name: block kind or 'first-order'}``: which gradients are scored."""
        return dict(self._coverage)

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` ran (or a fit was loaded)."""
        return all(f.based and f.lam_sum is not None for f in self._factors.values())

    def fit(self, batches: Callable[[], Iterable[Batch]], *,
            factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """The covariances, eigenbases and ``Λ`` over the training set.

        Args:
            batches: Called twice (the factor pass, then the ``Λ`` pass), each time
                yielding the training set's ``(inputs, targets)`` batches in order; once
                (the ``Λ`` pass) with ``factors``.
            factors: ``{block name: (A, G)}`` running factors of a training run
                (:func:`running_factors`) whose eigenvectors are the bases, instead of
                the factor pass (``docs/conventions.md``, "Influence", seeding).

        Raises:
            ValueError: ``factors`` miss a block or have another shape; nothing is fitted.
        """
        if factors is not None:
            self._factors = seeded(self.blocks, factors, self.dtype)
        else:
            self._covariances(batches())
        with self._observer.installed():
            for inputs, targets in self._observer.each(batches(), "Λ"):
                passed = self._observer.run(inputs, self._fisher_loss(targets))
                for name, parts in self._parts(passed).items():
                    f = self._factors[name]
                    square = f.rotated(parts).square().sum(0)
                    f.lam_sum = square if f.lam_sum is None else f.lam_sum.add_(square)
                    f.examples += passed.examples
        for name, f in self._factors.items():
            if f.lam_sum is None:  # no data on this rank
                f.lam_sum = torch.zeros(matrix_shape(self.blocks[name]), dtype=self.dtype,
                                        device=self._device)
        fits = list(self._factors.values())
        sums = self._ranks.summed([f.lam_sum for f in fits if f.lam_sum is not None],
                      [f.examples for f in fits])
        for f, (lam_sum, examples) in zip(self._factors.values(), sums, strict=True):
            f.lam_sum, f.examples = lam_sum, examples
            if examples == 0:
                raise ValueError("the training set is empty (the Λ pass saw no example)")

    def _covariances(self, batches: Iterable[Batch]) -> None:
        """Steps 1 and 2: the factor pass and the bases.

        The anchor's kinds from their rows; the others from the core's batch factors
        (:meth:`Observer.batch_factors`), in the same forward and backward pass.
        """
        self._factors = {name: BlockFit() for name in self.blocks}
        rowed = [name for name, b in self.blocks.items() if row_kind(b)]
        observer = self._observer
        observer.recording = {n for n, b in self.blocks.items()
                              if not row_kind(b) and any(summed_sides(b))}
        try:
            with observer.installed():
                for inputs, targets in observer.each(batches, "covariances"):
                    passed = observer.run(inputs, self._fisher_loss(targets))
                    for name in rowed:
                        for x, d, site in passed.calls[name]:
                            part = call_part(self.blocks[name], x, d, site, passed.examples,
                                             self.dtype)
                            assert isinstance(part, Rows)
                            a2, g2 = part.kept(passed.mask if observer.applies(name) else None)
                            self._factors[name].add(
                                self.blocks[name], ops.covariance(a2, 1.0)[None],
                                ops.covariance(g2, 1.0)[None], a2.shape[0], self.dtype)
                    for name, (a_batch, g_batch, n) in observer.batch_factors().items():
                        self._factors[name].add(
                            self.blocks[name], None if a_batch is None else a_batch * n,
                            None if g_batch is None else g_batch * n, n, self.dtype)
        finally:
            observer.recording = set()
        self._sum_and_decompose()

    def _sum_and_decompose(self) -> None:
        """The sums over the ranks, then each block's bases (step 2)."""
        decompose(self._factors, self.blocks, self._ranks, self.dtype, self._device)

    def _fisher_loss(self, targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The pass's loss of the outputs: with the targets, or labels drawn from them."""
        def value(outputs: torch.Tensor) -> torch.Tensor:
            return self.loss(outputs, self._draw(outputs, targets))

        return value

    def _draw(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The Fisher labels of a batch: its targets, or drawn from its outputs."""
        if self.fisher is Fisher.EMPIRICAL:
            return targets
        logits = logits_of(outputs).detach()
        probs = F.softmax(logits.reshape(-1, logits.shape[-1]).double(), dim=-1)
        # inverse-CDF draws, one uniform per position from the CPU generator
        uniform = torch.rand(probs.shape[0], 1, generator=self.generator, dtype=torch.float64)
        cdf = probs.cumsum(-1)
        drawn = torch.searchsorted(cdf, uniform.to(cdf.device) * cdf[:, -1:])[:, 0]
        drawn = drawn.clamp_(max=probs.shape[-1] - 1).reshape(targets.shape)
        return torch.where(targets == IGNORE_INDEX, targets, drawn)  # padding stays ignored

    # ------------------------------------------------------------------ scores
    def pairwise_scores(self, queries: Iterable[Batch], train: Iterable[Batch], *,
                        measurement: Measurement | None = None,
                        query_rank: int | None = None) -> torch.Tensor:
        """``(n_query, n_train)`` scores, summed over blocks (:meth:`block_pairwise_scores`).

        Each query's preconditioned gradient against each training example's gradient
        (of its loss with its true label).

        Args:
            queries: The queries' ``(inputs, targets)`` batches.
            train: The training examples' batches, in order.
            measurement: ``(outputs, targets) -> summed scalar`` of the queries; their
                summed loss by default.
            query_rank: Keep each preconditioned query gradient matrix as its rank-``k``
                truncation (``k (rows + columns)`` numbers instead of ``rows x columns``;
                Kronfluence's ``query_gradient_low_rank``); ``None``: whole.
        """
        parts = self.block_pairwise_scores(queries, train, measurement=measurement,
                                           query_rank=query_rank)
        return torch.stack(list(parts.values())).sum(0)

    def block_pairwise_scores(self, queries: Iterable[Batch], train: Iterable[Batch], *,
                              measurement: Measurement | None = None,
                              query_rank: int | None = None) -> dict[str, torch.Tensor]:
        """:meth:`pairwise_scores` per block: ``{block name: (n_query, n_train)}``."""
        per_block = self._preconditioned_queries(queries, measurement or self.loss, query_rank)
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        with self._observer.installed():
            for inputs, targets in self._observer.each(train, "pairwise scores"):
                passed = self._observer.run(inputs, partial(_flipped, self.loss, targets))
                for name, parts in self._parts(passed).items():
                    g = summed(p.matrices() for p in parts)
                    columns[name].append(per_block[name].dense().flatten(1) @ g.flatten(1).T)
        return {name: self._ranks.gathered(torch.cat(parts, dim=1) if parts else  # no shard
                                           per_block[name].dense().new_zeros(
                                               per_block[name].count, 0))
                for name, parts in columns.items()}

    def token_scores(self, queries: Iterable[Batch], train: Iterable[Batch], *,
                     measurement: Measurement | None = None,
                     query_rank: int | None = None) -> torch.Tensor:
        """``(n_query, n_train, positions)``: each training example's score by token.

        The terms of :meth:`pairwise_scores` of each row of each layer's calls (its
        positions, for a sequence model), summed over layers; they sum to the pairwise
        scores. Every scored layer's rows must be the same positions.
        """
        per_block = self._preconditioned_queries(queries, measurement or self.loss, query_rank)
        columns: list[torch.Tensor] = []
        with self._observer.installed():
            for inputs, targets in self._observer.each(train, "token scores"):
                passed = self._observer.run(inputs, partial(_flipped, self.loss, targets))
                dense = {name: q.dense() for name, q in per_block.items()}
                columns.append(token_terms(self._parts(passed), dense))
        count = next(iter(per_block.values())).count
        longest = max([c.shape[-1] for c in columns], default=1)
        mine = torch.tensor([[float(longest)]], device=self._device)
        longest = int(self._ranks.gathered(mine).max())
        local = torch.cat([F.pad(c, (0, longest - c.shape[-1])) for c in columns], dim=1
                          ) if columns else torch.zeros(count, 0, longest, dtype=self.dtype,
                                                        device=self._device)
        # (Q, n, R): sequences shorter than the longest padded with zero terms, gathered
        # along the examples
        return self._ranks.gathered(local.transpose(1, 2)).transpose(1, 2)

    def self_scores(self, train: Iterable[Batch]) -> torch.Tensor:
        """``(n_train,)``: each example's preconditioned gradient against itself.

        Summed over blocks (:meth:`block_self_scores`).
        """
        return torch.stack(list(self.block_self_scores(train).values())).sum(0)

    def block_self_scores(self, train: Iterable[Batch]) -> dict[str, torch.Tensor]:
        """:meth:`self_scores` per block: ``{block name: (n_train,)}``."""
        out: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        with self._observer.installed():
            for inputs, targets in self._observer.each(train, "self scores"):
                passed = self._observer.run(inputs, partial(_flipped, self.loss, targets))
                for name, parts in self._parts(passed).items():
                    rotated = self._factors[name].rotated(parts)
                    out[name].append((rotated.square() * self._inverse(name)).flatten(1).sum(1))
        return {name: self._ranks.gathered(torch.cat(parts) if parts else
                               torch.zeros(0, dtype=self.dtype, device=self._device))
                for name, parts in out.items()}

    def block_damping(self, name: str) -> float:
        """The damping of block ``name``: absolute, or ``0.1 mean(Λ)``."""
        if self.damping is not None:
            return float(self.damping)
        return float(HEURISTIC_DAMPING * self._factors[name].lam().mean())

    def _preconditioned_queries(self, queries: Iterable[Batch], measurement: Measurement,
                                rank: int | None) -> dict[str, Queries]:
        """Per block, ``P(G_q)`` of every query ``(n_query, groups, rows, columns)``.

        Computed by the block's gradient workers, batch by batch (truncated to ``rank``
        there), then sent to the other ranks (:meth:`Ranks.spread`).
        """
        check_rank(rank)  # a bad rank refused before any pass
        parts: dict[str, list[Queries]] = {name: [] for name in self.blocks}
        count = 0
        with self._observer.installed():
            for inputs, targets in self._observer.each(queries, "queries"):
                passed = self._observer.run(inputs, partial(_flipped, measurement, targets))
                count += passed.examples
                for name, pieces in self._parts(passed).items():
                    if self._ranks.computes(name):
                        f = self._factors[name]
                        p = f.rotate_back(f.rotated(pieces) * self._inverse(name))
                        parts[name].append(Queries.of(p, rank))
        if count == 0:
            raise ValueError("no query: the query batches are empty")
        out: dict[str, Queries] = {}
        for field in ("whole",) if rank is None else ("left", "right"):
            mine = {name: torch.cat([getattr(q, field) for q in qs]) if qs else None
                    for name, qs in parts.items()}
            shapes = {name: query_shape(count, matrix_shape(b), field, rank)
                      for name, b in self.blocks.items()}
            for name, t in self._ranks.spread(mine, shapes, self.dtype, self._device).items():
                setattr(out.setdefault(name, Queries()), field, t)
        return out

    def _inverse(self, name: str) -> torch.Tensor:
        """``1 / (Λ + λ)`` of block ``name``."""
        if not self.fitted:
            raise RuntimeError("EKFACInfluence: call fit() (or load a fit) before scoring")
        return 1.0 / (self._factors[name].lam() + self.block_damping(name))

    def _parts(self, passed: Pass) -> dict[str, list[Part]]:
        """Per block, the examples' parts of its gradient from each of its calls.

        A block the pass did not reach (no call) has zero gradients.
        """
        out: dict[str, list[Part]] = {}
        n = passed.examples
        for name, block in self.blocks.items():
            mask = passed.mask if self._observer.applies(name) else None
            out[name] = [call_part(block, x, d, site, n, self.dtype, mask)
                         for x, d, site in passed.calls.get(name, [])] or [Unreached(
                torch.zeros(n, *matrix_shape(block), dtype=self.dtype, device=self._device))]
        return out

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """The fit: per block its bases (absent: the identity), ``Λ``'s sum and counts."""
        if not self.fitted:
            raise RuntimeError("EKFACInfluence: nothing to save before fit()")
        return {"fisher": self.fisher.value,
                "blocks": {name: f.entry() for name, f in self._factors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; a fit of another model is refused, nothing loaded."""
        blocks = state.get("blocks") if isinstance(state, dict) else None
        if not isinstance(blocks, dict) or set(blocks) != set(self.blocks):
            raise ValueError("not an EKFACInfluence fit of this model (its layers differ)")
        self._factors = {name: BlockFit.loaded(self.blocks[name], entry, self.dtype,
                                               self._device) for name, entry in blocks.items()}

    def save(self, path: str | Path) -> None:
        """Writes :meth:`state_dict` to ``path`` (a directory: ``path/fit.pt``)."""
        file = fit_file(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), file)

    def load(self, path: str | Path) -> None:
        """Reads a :meth:`save` file or directory (a foreign one refused in one line)."""
        self.load_state_dict(read(fit_file(path), "an EKFACInfluence fit"))


def _flipped(loss: Measurement, targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``loss(outputs, targets)``, ``targets`` bound first (for :func:`functools.partial`)."""
    return loss(outputs, targets)
