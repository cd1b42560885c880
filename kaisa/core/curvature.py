"""The K-FAC curvature core: one estimator under every product.

:class:`KFACCurvature` owns the curvature blocks (:mod:`kaisa.blocks`), the statistics
recorder (:mod:`kaisa.core.hooks`), the distributed engine (:mod:`kaisa.distributed.engine`)
and the second-order method (:mod:`kaisa.methods`). It holds no hyperparameter that
changes during training: every phase takes what it needs as an explicit argument, and it
never calls up into the product that drives it.

Phases, in the order a step uses them:

* arm the recording (:meth:`~KFACCurvature.arm` with the step's running-average decay, which
  folds the statistics into the running factors where they are computed,
  :mod:`kaisa.core.folding`; or :attr:`~KFACCurvature.recording` alone, which keeps batch
  factors until ``step()``) and scope which backward passes record output gradients
  (:meth:`~KFACCurvature.output_gradients`);
* :meth:`~KFACCurvature.update_factors` (the running-average decay);
* :meth:`~KFACCurvature.update_decompositions` (the damping);
* :meth:`~KFACCurvature.precondition` (the damping; gradients given or read from
  ``.grad``), returning :class:`~kaisa.blocks.Preconditioned` directions and writing
  nothing, or :meth:`~KFACCurvature.transform` (a product's per-block rule in place of the
  method's preconditioning: EKFAC's Adam step in the eigenbasis, KFACMuon's step);
* :meth:`~KFACCurvature.end_step`, or :meth:`~KFACCurvature.discard` for an abandoned
  step;
* rank reductions (:meth:`~KFACCurvature.any_rank`, :meth:`~KFACCurvature.mean_over_ranks`)
  and the state dict.

:class:`~kaisa.KFACPreconditioner` (kfac-pytorch's API: schedules, KL clip, write-back),
:class:`~kaisa.KFAC` (quadratic model, AMP), :class:`~kaisa.EKFAC` and
:class:`~kaisa.KFACMuon` are products around it. The class is written in four modules:
this one (construction, layout, factor and decomposition phases),
:mod:`kaisa.core.recording` (arming the hooks), :mod:`kaisa.core.directions`
(preconditioning and product rules) and :mod:`kaisa.core.state` (ranks, checkpoints,
sizes).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from kaisa.blocks import CurvatureBlock, register_blocks
from kaisa.blocks.attention import undecided_attention
from kaisa.blocks.state import fold_all
from kaisa.core.config import KFACConfig
from kaisa.core.coverage import FIRST_ORDER, coverage_line, parameter_coverage
from kaisa.core.directions import DirectionPhases
from kaisa.core.folding import FactorFolding
from kaisa.core.grouped import BlockGroup
from kaisa.core.hooks import StatisticsRecorder
from kaisa.core.recording import RecordingControl
from kaisa.core.schedule import block_cost, blocks_due, spread_parts, warm_refresh
from kaisa.core.state import CurvatureState
from kaisa.distributed import LARGE_FACTOR_DIM, DistributedEngine
from kaisa.distributed.memory import large_factor_message
from kaisa.methods import SecondOrderMethod, make_method
from kaisa.utils.enums import FactorStorage
from kaisa.utils.profiling import timed

__all__ = ["FIRST_ORDER", "TIMING_KEYS", "KFACCurvature"]

logger = logging.getLogger("kaisa")

#: Host seconds the core accounts, by phase.
TIMING_KEYS = ("factors", "communication", "decompositions", "preconditioning")


class KFACCurvature(RecordingControl, DirectionPhases, CurvatureState):
    """Kronecker-factored curvature of a model's registered blocks, on every rank.

    Args:
        model: The model; its supported modules become blocks.
        config: The validated configuration (its schedules and ``lr``/``kl_clip`` are
            the products' business; the core reads the structural fields).
        stacklevel: Where construction warnings point (the product's caller).
        settings: The product's own settings every rank must share.
        method: The second-order method (default: ``config.compute_method``'s); a product
            whose rule keeps state with the decompositions brings its own.
        factor_rows: Rows each call of a Linear, attention or embedding block keeps for its
            statistics (a random subset, ``docs/conventions.md``; ``None``: every row). Needs
            ``config.update_factors_in_hook``.
        row_generator: The product's CPU generator the subsets are drawn from.
        max_dense_dim: Linear and attention blocks keep each side larger than this as its
            diagonal (``docs/conventions.md``, "One-sided bases"; ``None``: dense).

    Raises:
        ValueError: If the model has no supported block.
    """

    def __init__(
        self,
        model: nn.Module,
        config: KFACConfig,
        *,
        stacklevel: int = 2,
        settings: Mapping[str, object] | None = None,
        method: SecondOrderMethod | None = None,
        factor_rows: int | None = None,
        row_generator: torch.Generator | None = None,
        max_dense_dim: int | None = None,
        bias_columns: bool = True,
    ) -> None:
        if factor_rows is not None and not config.update_factors_in_hook:
            raise ValueError("factor_rows needs update_factors_in_hook=True (the row subsets "
                             "are drawn in the hooks)")
        self._timings = dict.fromkeys(TIMING_KEYS, 0.0)
        self._warned_silent: set[str] = set()
        #: Blocks whose hooks did not fire in the last step that recorded (first-order).
        self._silent: set[str] = set()
        blocks = register_blocks(model, skip=config.skip_patterns, factor_dtype=config.factor_dtype,
                                 kfac_approx=config.kfac_approx, kinds=config.layer_kinds,
                                 cross_attention=config.cross_attention_patterns,
                                 factor_rows=factor_rows, row_generator=row_generator,
                                 max_dense_dim=max_dense_dim)
        self._bias_columns = bias_columns
        _drop_bias_columns(blocks.values(), bias_columns)
        # Before anything a rank could refuse alone: every rank raises or none does.
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        layers = [(name, b.kind, tuple(b.dims)) for name, b in blocks.items()]
        self.check_same_on_ranks(
            {**config.settings(), **(settings or {}), "layers": layers},
            what="K-FAC configuration",
        )
        if not blocks:
            raise ValueError(
                f"model has no supported layer to precondition (of the kinds {config.layer_kinds}"
                ", e.g. nn.Linear, nn.Conv2d, with trainable weights, not matched by "
                "skip_layers)"
            )
        self._blocks = blocks
        _keep_packed(blocks.values(), config)
        self._inv_dtype = config.inv_dtype
        self._method = method or make_method(
            config.compute_method, outer_product=config.compute_eigenvalue_outer_product
        )
        for block in blocks.values():
            if not block.diagonal:
                block.method = self._method
        self._engine = DistributedEngine(
            blocks, config.engine_config(_weight_dtype(blocks)), self._method, timings=self._timings
        )
        self._folding = FactorFolding(config.accumulation_steps)
        self._recorder = StatisticsRecorder(
            blocks,
            in_hook=config.update_factors_in_hook,
            grad_scaler=config.grad_scaler,
            accumulation_steps=config.accumulation_steps,
            on_layer_done=lambda layer: self._folding.fold_averages(
                self._blocks, self._engine.layer_done(layer)),
            on_backward_end=lambda: self._folding.fold_averages(
                self._blocks, self._engine.backward_end()),
            timings=self._timings,
            on_statistics=self._folding.fold,
            on_micro_batch_end=lambda: self._folding.leftovers(self._blocks.values()),
        )
        # What a relayout rebuilds blocks and the engine from (cross-attention detected).
        self._model, self._config = model, config
        self._row_options = (factor_rows, row_generator, max_dense_dim)
        self._cross: set[int] = set()
        self._groups: dict[tuple[object, ...], list[BlockGroup]] = {}
        self._spread: list[list[str]] | None = None  # decomposition_spread's parts
        self._probes = {
            id(m): m.register_forward_pre_hook(self._probe, with_kwargs=True, prepend=True)
            for m in undecided_attention(blocks)
        } if config.cross_attention_patterns is None else {}
        for f in self.factor_sizes():
            if f.dim > LARGE_FACTOR_DIM and not f.diagonal:
                warnings.warn(large_factor_message(f), RuntimeWarning, stacklevel=stacklevel + 1)
        logger.log(
            config.loglevel,
            "kaisa: registered %d layers: %s",
            len(blocks),
            ", ".join(f"{n} ({type(b.module).__name__})" for n, b in blocks.items()),
        )
        self._coverage = parameter_coverage(model, blocks)
        logger.info("%s", self.coverage_summary(model))

    # ------------------------------------------------------------------ layout
    def _probe(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """An MHA's first call: cross-attention (the query, key and value are not one tensor).

        A forward pre-hook run before the recorder's: on a cross-attention call the MHA's
        blocks are rebuilt in the cross-attention layout (:meth:`_relayout`) and this very
        call is recorded in it.
        """
        if torch.compiler.is_compiling():
            return  # decided in eager mode only; the self-attention layout stays until then
        handle = self._probes.pop(id(module), None)
        if handle is None:
            return
        handle.remove()
        q, k, v = (args[i] if i < len(args) else kwargs.get(name)
                   for i, name in enumerate(("query", "key", "value")))
        if q is k and k is v:
            return
        if any(b.factors.a is not None or b.factors.g is not None for b in self._blocks.values()):
            return  # factors exist: keep the layout (the tap warns about such calls)
        self._relayout(module)

    def _relayout(self, module: nn.Module) -> None:
        """Rebuilds ``module``'s blocks in the cross-attention layout, and the engine."""
        config = self._config
        self._cross.add(id(module))
        rows, generator, dense = self._row_options
        fresh = register_blocks(self._model, skip=config.skip_patterns,
                                factor_dtype=config.factor_dtype, kfac_approx=config.kfac_approx,
                                kinds=config.layer_kinds, cross_attention=None,
                                cross_modules=self._cross, factor_rows=rows,
                                row_generator=generator, max_dense_dim=dense)
        new = {n: b for n, b in fresh.items() if b.module is module}
        _drop_bias_columns(new.values(), self._bias_columns)
        blocks: dict[str, CurvatureBlock] = {}
        for name, block in self._blocks.items():
            if block.module is not module:
                blocks[name] = block
            elif not blocks.keys() & new.keys():
                blocks.update(new)
        _keep_packed(new.values(), config)
        for block in new.values():
            if not block.diagonal:
                block.method = self._method
        self.check_same_on_ranks({"layers": [(n, b.kind, tuple(b.dims)) for n, b in
                                             blocks.items()]}, what="K-FAC layers")
        old = self._engine
        engine = DistributedEngine(blocks, config.engine_config(_weight_dtype(self._blocks)),
                                   self._method, communicator=old.communicator,
                                   timings=self._timings)
        if engine.grid.fraction != old.grid.fraction:  # "auto" chose again: other groups
            engine = DistributedEngine(blocks, config.engine_config(_weight_dtype(self._blocks)),
                                       self._method, timings=self._timings)
        self._blocks, self._engine = blocks, engine
        self._folding.apply(blocks.values(), self._foldable)
        self._recorder.retap(module, blocks)
        self._coverage = parameter_coverage(
            self._model, {n: b for n, b in blocks.items() if n not in self._silent})
        logger.info("kaisa: %s was called with a query, key and value that are not one "
                    "tensor: registered in the cross-attention layout (%s)",
                    type(module).__name__, ", ".join(new))

    # ------------------------------------------------------------------ what it holds
    @property
    def blocks(self) -> dict[str, CurvatureBlock]:
        """The blocks by module name, in model order."""
        return dict(self._blocks)

    @property
    def layers(self) -> dict[str, CurvatureBlock]:
        """The blocks under kfac-pytorch's name (``KFACPreconditioner.layers``)."""
        return self.blocks

    def coverage(self) -> dict[str, str]:
        """``{parameter name: block kind or 'first-order'}`` for every trainable parameter.

        Names as ``model.named_parameters()`` gives them (a tied parameter once, under its
        first name), at construction. A block whose hooks did not fire in a step that
        recorded (its weight used without calling its module) is ``'first-order'`` until
        they do: nothing preconditions it.
        """
        return dict(self._coverage)

    def coverage_summary(self, model: nn.Module) -> str:
        """One line: how many parameters and elements the blocks cover, and the rest."""
        return coverage_line(self._coverage, model, len(self._blocks))

    @property
    def engine(self) -> DistributedEngine:
        """The distributed engine (rank, world size, grid, placement, communicator)."""
        return self._engine

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative host seconds by phase (on CUDA, launch time unless synchronised)."""
        return dict(self._timings)

    def reset_timings(self) -> None:
        """Zeroes :attr:`timings` (in place: the engine and the hooks add to the same dict)."""
        for key in self._timings:
            self._timings[key] = 0.0

    def timed(self, key: str) -> AbstractContextManager[None]:
        """Adds the block's host seconds to ``timings[key]`` (:class:`.profiling.timed`)."""
        return timed(self._timings, key)

    # ------------------------------------------------------------------ phases
    def update_factors(self, decay: float, *, zero_start: bool = False) -> None:
        """Averages the step's batch factors over ranks and folds them in.

        Args:
            decay: The running-average decay ``rho``.
            zero_start: Running factors start from zero, not the identity.
        """
        with self.timed("factors"):
            # Statistics computed in step(), or recorded by a forward pass without backward.
            self._folding.leftovers(self._blocks.values(),
                                    whole_step=not self._config.update_factors_in_hook)
            self._recorder.compute_saved()
            items = [(block.factors, *block.combine(*averaged))
                     for block, averaged in ((self._blocks[name], averaged) for name, averaged
                                             in self._engine.averaged_factors().items())]
            fold_all(items, decay, zero_start=zero_start)
            if self._folding.folded or any(a is not None or g is not None for _, a, g in items):
                self._warn_silent_blocks()

    @property
    def on_cuda(self) -> bool:
        """Whether the model (its first parameter) is on a CUDA device."""
        return self._device.type == "cuda"

    def scheduled_decompositions(self, step: int, interval: int, damping: float) -> None:
        """The decompositions step ``step`` is due, as configured, with ``interval``.

        The blocks :meth:`decompositions_due` names (none: nothing happens), warm-started
        when the configuration's ``basis_refresh`` says so for decomposition step
        ``step // interval`` (:func:`kaisa.core.schedule.warm_refresh`).

        Args:
            step: The step count.
            interval: ``inv_update_steps`` at this step.
            damping: The damping the method uses.
        """
        due = self.decompositions_due(step, interval)
        if due:
            config = self._config
            self.update_decompositions(
                damping, blocks=due,
                warm_start=warm_refresh(step // interval, config.basis_refresh,
                                        config.eigh_every, cuda=self.on_cuda))

    def decompositions_due(self, step: int, interval: int) -> frozenset[str]:
        """The blocks step ``step`` decomposes, with ``interval = inv_update_steps``.

        Every block when ``step % interval == 0`` with ``decomposition_spread=1``; with
        ``decomposition_spread=k`` the parts due (``docs/conventions.md``, "Spread
        decompositions"). Empty: none.

        Args:
            step: The step count.
            interval: ``inv_update_steps`` at this step.
        """
        return blocks_due(step, interval, self.decomposition_parts)

    @property
    def decomposition_parts(self) -> list[list[str]]:
        """``decomposition_spread``'s parts: per part its blocks' names (made once)."""
        if self._spread is None:
            costs = [(name, block_cost(block)) for name, block in self._blocks.items()]
            self._spread = spread_parts(costs, self._config.decomposition_spread)
        return self._spread

    def update_decompositions(
        self, damping: float, *, warm_start: bool = False,
        blocks: Collection[str] | None = None,
    ) -> None:
        """Decomposes the factors (as placed) and sends them to the gradient workers.

        Args:
            damping: The damping the method uses.
            warm_start: Let the method start from the stored decompositions
                (:meth:`~kaisa.methods.SecondOrderMethod.refresh_dense`).
            blocks: The names of the blocks to decompose (:meth:`decompositions_due`);
                ``None``: every block.
        """
        with self.timed("decompositions"):
            self._engine.update_decompositions(damping, warm_start=warm_start, blocks=blocks)

    def end_step(self) -> None:
        """Ends a step: the recorder's per-step counters restart (and unused row draws go)."""
        for block in self._blocks.values():
            block.stats.row_draws.clear()
        self._recorder.end_step()
        self._folding.end_round()

    def discard(self) -> None:
        """Forgets what was recorded since the last step (no step follows)."""
        for block in self._blocks.values():
            block.stats.clear()
        self._engine.drop_pending()
        self._recorder.end_step()
        self._folding.end_round()

    def remove_hooks(self) -> None:
        """Detaches the core from the model's modules."""
        self._recorder.remove()
        for handle in self._probes.values():
            handle.remove()
        self._probes.clear()

    def load_state_dict(
        self, state: Mapping[str, Any], *, damping: float, compute_inverses: bool = True
    ) -> None:
        """:meth:`CurvatureState.load_state_dict`, then the saved run's silent blocks."""
        super().load_state_dict(state, damping=damping, compute_inverses=compute_inverses)
        silent = self._silent_blocks()
        if len(silent) < len(self._blocks) and silent != self._silent:  # a run that recorded
            self._silent = silent
            self._coverage = parameter_coverage(
                self._model, {n: b for n, b in self._blocks.items() if n not in silent})

    def _silent_blocks(self) -> set[str]:
        """The blocks this rank should hold factors of and holds none of."""
        return {name for name, block in self._blocks.items()
                if block.factors.a is None and block.factors.g is None
                and self._engine.holds_factors(name)}  # FSDP2: the others hold none

    def _warn_silent_blocks(self) -> None:
        """Warns of blocks whose hooks never fired; :meth:`coverage` says first-order.

        Once their hooks fire (factors exist), the coverage gives their kind again.
        """
        silent = self._silent_blocks()
        for name in sorted(silent - self._warned_silent, key=list(self._blocks).index):
            block = self._blocks[name]
            msg = (
                f"kaisa: the hooks of registered layer {name!r} "
                f"({type(block.module).__name__}) did not fire ({block.silent_hint}); it is "
                "left unpreconditioned (first-order in coverage()) until they do"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=5)
            logger.warning(msg)
        self._warned_silent |= silent
        if silent != self._silent:
            self._silent = silent
            self._coverage = parameter_coverage(
                self._model, {n: b for n, b in self._blocks.items() if n not in silent})


def _drop_bias_columns(blocks: Iterable[CurvatureBlock], keep: bool) -> None:
    """Without bias columns (``keep`` false), each Kronecker block is its weight alone."""
    for block in blocks:
        if not keep and not block.diagonal:
            block.drop_bias_column()


def _keep_packed(blocks: Iterable[CurvatureBlock], config: KFACConfig) -> None:
    """Kronecker blocks keep their dense factors packed with ``factor_storage='packed'``."""
    for block in blocks:
        block.factors.packed = (config.factor_storage is FactorStorage.PACKED
                                and not block.diagonal)


def _weight_dtype(blocks: Mapping[str, CurvatureBlock]) -> torch.dtype:
    """The weights' dtype (of the first block): the distributed config's default."""
    return next(iter(blocks.values())).weight.dtype
