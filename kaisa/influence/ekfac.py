"""EK-FAC influence scores on kaisa's blocks (``docs/conventions.md``, "Influence").

:class:`EKFACInfluence` fits, over a training set read in order, each block's covariances
``A`` and ``S`` (the factor pass, with the Fisher's labels), their eigenbases, and the
corrected eigenvalues ``Λ`` from per-example gradients (a second pass with fresh labels),
then computes pairwise scores (queries x training examples) and self-influence scores.
The blocks are kaisa's (:func:`kaisa.blocks.register_blocks`): ``nn.Linear``, Hugging
Face's transposed ``Conv1D`` and ``nn.Conv2d`` (one group) here; a block observed through
functional calls (attention, experts) or of another kind is not scored yet and is
reported ``"first-order"`` by :meth:`EKFACInfluence.coverage`.

Under ``torch.distributed`` each rank passes its own contiguous shard of the training set
(rank 0 the first): the sums and counts of both passes are summed over the ranks (every
rank then holds the same fit), and the scores of each rank's shard are gathered, in rank
order, on every rank (kaisa's communicator, :mod:`kaisa.distributed`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kaisa.blocks import register_blocks
from kaisa.core.coverage import FIRST_ORDER
from kaisa.distributed.torch_comm import make_communicator
from kaisa.influence.ranks import gathered, summed
from kaisa.influence.rows import basis, evaluating, observe, scored

__all__ = ["EKFACInfluence", "Fisher"]

#: A batch: ``(inputs, targets)``; the model is called on ``inputs``.
Batch = tuple[torch.Tensor, torch.Tensor]
#: ``(outputs, targets) -> summed scalar`` (a query's measurement).
Measurement = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

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


def summed_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy over every position (no ``1/B``)."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1),
                           reduction="sum")


@dataclass
class _Factors:
    """One block's sums and counts, then its bases and ``Λ``."""

    a_sum: torch.Tensor | None = None
    s_sum: torch.Tensor | None = None
    rows: int = 0
    lam_sum: torch.Tensor | None = None
    examples: int = 0
    qa: torch.Tensor | None = None
    qs: torch.Tensor | None = None

    def lam(self) -> torch.Tensor:
        assert self.lam_sum is not None and self.examples > 0
        return self.lam_sum / self.examples


class EKFACInfluence:
    """EK-FAC influence: fit once on the training set, then score queries.

    Args:
        model: The trained model (its mode is restored after each pass; the passes run it
            in evaluation mode).
        fisher: ``'true'`` (labels drawn from the model, with ``seed``) or
            ``'empirical'`` (the batches' targets).
        damping: Added to ``Λ`` at score time: a number, or ``None`` for
            ``0.1 mean(Λ)`` per block.
        seed: Seed of the generator the true Fisher's labels are drawn with.
        dtype: Dtype of the statistics and scores (eigendecompositions run in float64).
        layer_kinds: Block kinds to track (``"linear"``, ``"conv2d"``).
        loss: ``(outputs, targets) -> summed loss`` of a batch; the summed cross-entropy
            by default (the true Fisher draws classification labels for it).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        fisher: Fisher | str = Fisher.TRUE,
        damping: float | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        layer_kinds: tuple[str, ...] = ("linear", "conv2d"),
        loss: Measurement = summed_cross_entropy,
    ) -> None:
        self.model = model
        self.fisher = Fisher(fisher)
        if damping is not None and not damping >= 0:
            raise ValueError(f"damping must be >= 0 or None, got {damping!r}")
        self.damping = damping
        self.dtype = dtype
        self.loss = loss
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._comm = make_communicator(groups=[tuple(range(world))] if world > 1 else ())
        self.generator = torch.Generator().manual_seed(seed + self._comm.rank)
        self._device = next(model.parameters()).device
        blocks = register_blocks(model, kinds=layer_kinds)
        self.blocks = {name: b for name, b in blocks.items() if scored(b)}
        if not self.blocks:
            raise ValueError("model has no layer influence can track (nn.Linear, nn.Conv2d)")
        self._factors = {name: _Factors() for name in self.blocks}
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
        return all(f.qa is not None and f.lam_sum is not None for f in self._factors.values())

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
            self._seed(factors)
        else:
            self._covariances(batches())
        for inputs, targets in batches():
            grads = self._gradients(inputs, self._labels(inputs, targets))
            for name, g in grads.items():
                f = self._factors[name]
                assert f.qa is not None and f.qs is not None
                square = (f.qs.T @ g @ f.qa).square().sum(0)
                f.lam_sum = square if f.lam_sum is None else f.lam_sum.add_(square)
                f.examples += g.shape[0]
        for name, f in self._factors.items():
            if f.lam_sum is None:
                a_dim, g_dim = self.blocks[name].dims
                f.lam_sum = torch.zeros(g_dim, a_dim, dtype=self.dtype,  # no data on this rank
                                        device=self._device)
        fits = list(self._factors.values())
        sums = summed(self._comm, [f.lam_sum for f in fits if f.lam_sum is not None],
                      [f.examples for f in fits])
        for f, (lam_sum, examples) in zip(self._factors.values(), sums, strict=True):
            f.lam_sum, f.examples = lam_sum, examples
            if examples == 0:
                raise ValueError("the training set is empty (the Λ pass saw no example)")

    def _seed(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The bases from a training run's running factors (checked first)."""
        for name, block in self.blocks.items():
            pair = factors.get(name)
            dims = block.dims
            if pair is None or tuple(pair[0].shape) != (dims[0],) * 2 or tuple(
                    pair[1].shape) != (dims[1],) * 2:
                raise ValueError(f"the running factors of layer {name!r} are not "
                                 f"{dims[0]}x{dims[0]} and {dims[1]}x{dims[1]} (another "
                                 "model, or blocks without a bias column?)")
        self._factors = {name: _Factors(qa=basis(factors[name][0]).to(self.dtype),
                                        qs=basis(factors[name][1]).to(self.dtype))
                         for name in self.blocks}

    def _covariances(self, batches: Iterable[Batch]) -> None:
        """Steps 1 and 2: the factor pass and the bases."""
        self._factors = {name: _Factors() for name in self.blocks}
        for inputs, targets in batches:
            observed = observe(self.model, self.blocks, inputs,
                               partial(_flipped, self.loss, self._labels(inputs, targets)),
                               self.dtype)
            for name, (a, g) in observed.items():
                f = self._factors[name]
                a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
                f.a_sum = a2.T @ a2 if f.a_sum is None else f.a_sum.addmm_(a2.T, a2)
                f.s_sum = g2.T @ g2 if f.s_sum is None else f.s_sum.addmm_(g2.T, g2)
                f.rows += a2.shape[0]
        for name, f in self._factors.items():
            if f.a_sum is None or f.s_sum is None:  # no data on this rank: zeros to sum
                a_dim, g_dim = self.blocks[name].dims
                f.a_sum = torch.zeros(a_dim, a_dim, dtype=self.dtype, device=self._device)
                f.s_sum = torch.zeros(g_dim, g_dim, dtype=self.dtype, device=self._device)
        fits = list(self._factors.values())
        counts = [f.rows for f in fits]
        a_sums = summed(self._comm, [f.a_sum for f in fits if f.a_sum is not None], counts)
        s_sums = summed(self._comm, [f.s_sum for f in fits if f.s_sum is not None], counts)
        for (name, f), (a_sum, rows), (s_sum, _) in zip(self._factors.items(), a_sums, s_sums,
                                                         strict=True):
            if rows == 0:
                raise ValueError(f"layer {name!r} saw no data in the factor pass")
            f.a_sum, f.s_sum, f.rows = a_sum, s_sum, rows
            f.qa = basis(f.a_sum / f.rows).to(self.dtype)
            f.qs = basis(f.s_sum / f.rows).to(self.dtype)

    def _labels(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The batch's Fisher labels: its targets, or drawn from the model's outputs."""
        if self.fisher is Fisher.EMPIRICAL:
            return targets
        with torch.no_grad(), evaluating(self.model):
            logits = self.model(inputs)
        probs = F.softmax(logits.reshape(-1, logits.shape[-1]).double(), dim=-1).cpu()
        drawn = torch.multinomial(probs, 1, generator=self.generator)[:, 0]  # a CPU generator
        drawn = drawn.to(targets.device).reshape(targets.shape)
        return torch.where(targets == IGNORE_INDEX, targets, drawn)  # padding stays ignored

    # ------------------------------------------------------------------ scores
    def pairwise_scores(self, queries: Iterable[Batch], train: Iterable[Batch], *,
                        measurement: Measurement | None = None) -> torch.Tensor:
        """``(n_query, n_train)`` scores, summed over blocks (:meth:`block_pairwise_scores`).

        Each query's preconditioned gradient against each training example's gradient
        (of its loss with its true label).

        Args:
            queries: The queries' ``(inputs, targets)`` batches.
            train: The training examples' batches, in order.
            measurement: ``(outputs, targets) -> summed scalar`` of the queries; their
                summed loss by default.
        """
        parts = self.block_pairwise_scores(queries, train, measurement=measurement)
        return torch.stack(list(parts.values())).sum(0)

    def block_pairwise_scores(self, queries: Iterable[Batch], train: Iterable[Batch], *,
                              measurement: Measurement | None = None
                              ) -> dict[str, torch.Tensor]:
        """:meth:`pairwise_scores` per block: ``{block name: (n_query, n_train)}``."""
        per_block = self._preconditioned_queries(queries, measurement or self.loss)
        columns: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        for inputs, targets in train:
            for name, g in self._gradients(inputs, targets).items():
                columns[name].append(torch.einsum("qoi,toi->qt", per_block[name], g))
        return {name: gathered(self._comm, torch.cat(parts, dim=1) if parts else
                               per_block[name].new_zeros(len(per_block[name]), 0))
                for name, parts in columns.items()}

    def self_scores(self, train: Iterable[Batch]) -> torch.Tensor:
        """``(n_train,)``: each example's preconditioned gradient against itself.

        Summed over blocks (:meth:`block_self_scores`).
        """
        return torch.stack(list(self.block_self_scores(train).values())).sum(0)

    def block_self_scores(self, train: Iterable[Batch]) -> dict[str, torch.Tensor]:
        """:meth:`self_scores` per block: ``{block name: (n_train,)}``."""
        out: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        for inputs, targets in train:
            for name, g in self._gradients(inputs, targets).items():
                out[name].append((self._precondition(name, g) * g).sum((1, 2)))
        return {name: gathered(self._comm, torch.cat(parts) if parts else
                               torch.zeros(0, dtype=self.dtype, device=self._device))
                for name, parts in out.items()}

    def block_damping(self, name: str) -> float:
        """The damping of block ``name``: absolute, or ``0.1 mean(Λ)``."""
        if self.damping is not None:
            return float(self.damping)
        return float(HEURISTIC_DAMPING * self._factors[name].lam().mean())

    def _preconditioned_queries(self, queries: Iterable[Batch],
                                measurement: Measurement) -> dict[str, torch.Tensor]:
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in self.blocks}
        for inputs, targets in queries:
            for name, g in self._gradients(inputs, targets, measurement).items():
                parts[name].append(self._precondition(name, g))
        return {name: torch.cat(p) for name, p in parts.items()}

    def _precondition(self, name: str, grads: torch.Tensor) -> torch.Tensor:
        """``QS ((QS^T G QA) / (Λ + λ)) QA^T`` of per-example gradients ``G``."""
        if not self.fitted:
            raise RuntimeError("EKFACInfluence: call fit() (or load a fit) before scoring")
        f = self._factors[name]
        assert f.qa is not None and f.qs is not None
        inverse = 1.0 / (f.lam() + self.block_damping(name))
        return f.qs @ ((f.qs.T @ grads @ f.qa) * inverse) @ f.qa.T

    # ------------------------------------------------------------------ observing
    def _gradients(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss: Measurement | None = None) -> dict[str, torch.Tensor]:
        """Per block, the examples' gradients ``(N, out, in [+1])`` of ``loss``."""
        rows = observe(self.model, self.blocks, inputs,
                       partial(_flipped, loss or self.loss, targets), self.dtype)
        return {name: torch.einsum("nro,nri->noi", g, a) for name, (a, g) in rows.items()}

    # ------------------------------------------------------------------ saving
    def state_dict(self) -> dict[str, Any]:
        """The fit: per block its bases, ``Λ``'s sum and count, and the rows counted."""
        if not self.fitted:
            raise RuntimeError("EKFACInfluence: nothing to save before fit()")
        return {"fisher": self.fisher.value, "blocks": {
            name: {"qa": f.qa, "qs": f.qs, "lam_sum": f.lam_sum, "examples": f.examples,
                   "rows": f.rows} for name, f in self._factors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`; a fit of another model is refused, nothing loaded."""
        blocks = state.get("blocks") if isinstance(state, dict) else None
        if not isinstance(blocks, dict) or set(blocks) != set(self.blocks):
            raise ValueError("not an EKFACInfluence fit of this model (its layers differ)")
        loaded = {}
        for name, entry in blocks.items():
            a_dim, g_dim = self.blocks[name].dims
            want = {"qa": (a_dim, a_dim), "qs": (g_dim, g_dim), "lam_sum": (g_dim, a_dim)}
            for key, shape in want.items():
                t = entry.get(key)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                    raise ValueError(f"the fit's {key} of layer {name!r} is not {shape} "
                                     "(a fit of another model?)")
            loaded[name] = _Factors(qa=entry["qa"].to(self.dtype), qs=entry["qs"].to(self.dtype),
                                    lam_sum=entry["lam_sum"].to(self.dtype),
                                    examples=int(entry["examples"]), rows=int(entry["rows"]))
        self._factors = loaded

    def save(self, path: str | Path) -> None:
        """Writes :meth:`state_dict` to ``path``."""
        torch.save(self.state_dict(), Path(path))

    def load(self, path: str | Path) -> None:
        """Reads a :meth:`save` file (refused in one line when it is not one of this model)."""
        try:
            state = torch.load(Path(path), weights_only=True)
        except Exception as error:  # a truncated or foreign file
            raise ValueError(f"{path}: not an EKFACInfluence fit ({error})") from error
        self.load_state_dict(state)


def _flipped(loss: Measurement, targets: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``loss(outputs, targets)``, ``targets`` bound first (for :func:`functools.partial`)."""
    return loss(outputs, targets)
