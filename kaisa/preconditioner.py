"""The K-FAC preconditioner: the public object, orchestrating the rooms of a step.

Configuration is :mod:`kaisa.config`, layers :mod:`kaisa.layers`, statistics recording
:mod:`kaisa.hooks`, the step's distribution :mod:`kaisa.distributed.engine` (one path at
every world size), the second-order math :mod:`kaisa.methods`, gradient write-back and
KL clipping :mod:`kaisa.clipping`. See ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from kaisa.clipping import write_preconditioned
from kaisa.config import HYPERPARAMETERS, KFACConfig
from kaisa.distributed import (
    LARGE_FACTOR_DIM,
    Communicator,
    DistributedEngine,
    FactorSize,
    MemoryEstimate,
    Placement,
)
from kaisa.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from kaisa.hooks import StatisticsRecorder
from kaisa.hyperparams import Schedule, scheduled_float, scheduled_int
from kaisa.layers import KFACLayer, register_layers
from kaisa.methods import make_method

__all__ = ["KFACPreconditioner"]

logger = logging.getLogger("kaisa")

TIMING_KEYS = ("factors", "communication", "decompositions", "preconditioning")


class KFACPreconditioner:
    """K-FAC gradient preconditioner (kfac-pytorch compatible arguments).

    Usage::

        pre = kaisa.KFACPreconditioner(model)
        loss.backward(); pre.step(); optimizer.step()

    Hyperparameters (``factor_update_steps``, ``inv_update_steps``, ``damping``,
    ``factor_decay``, ``kl_clip``, ``lr``) may be numbers or callables of the step.
    The math follows ``docs/conventions.md``.

    Distributed training (``docs/distributed.md``): when ``torch.distributed`` is
    initialised with more than one rank, the work is split with KAISA's
    ``grad_worker_fraction`` (:class:`DistributedStrategy`, a float in ``(0, 1]`` or
    ``'auto'`` with ``memory_budget_mb``). Factors are averaged over ranks by fused
    asynchronous allreduces started from the backward hooks; each layer's decompositions
    are computed by the rank(s) the placement assigns and broadcast to the layer's
    gradient workers, which precondition the gradient and broadcast it to the other
    ranks. Gradients must already be averaged over ranks when :meth:`step` runs
    (DistributedDataParallel, or an explicit allreduce), and every rank must run the same
    layers in the same order. With one rank everything is local.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule[int] = 1,
        inv_update_steps: Schedule[int] = 1,
        damping: Schedule[float] = 0.001,
        factor_decay: Schedule[float] = 0.95,
        kl_clip: Schedule[float] | None = 0.001,
        lr: Schedule[float] = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT,
        memory_budget_mb: float | None = None,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: str | list[str] | None = None,
        update_factors_in_hook: bool = True,
        loglevel: int = logging.DEBUG,
        collective_timeout: float | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        arguments = locals()
        self._config = config = KFACConfig(**{k: arguments[k] for k in KFACConfig.keywords()})
        self._model = model
        # The hyperparameter schedules (checkpoints restore the non-callable ones).
        self._schedules: dict[str, Any] = {name: getattr(config, name) for name in HYPERPARAMETERS}
        self._steps = 0
        self._timings = dict.fromkeys(TIMING_KEYS, 0.0)
        self._warned_silent: set[str] = set()

        self._layers = register_layers(
            model, skip=config.skip_patterns, factor_dtype=config.factor_dtype
        )
        if not self._layers:
            raise ValueError(
                "model has no supported layer to precondition (nn.Linear, nn.Conv2d with "
                "trainable weights, not matched by skip_layers)"
            )
        self._method = make_method(
            config.compute_method, outer_product=config.compute_eigenvalue_outer_product
        )
        for layer in self._layers.values():
            layer.method = self._method
        self._engine = DistributedEngine(
            self._layers, config, self._method, timings=self._timings
        )
        self._recorder = StatisticsRecorder(
            self._layers,
            recording=lambda: self._steps % self.factor_update_steps == 0,
            in_hook=config.update_factors_in_hook,
            grad_scaler=config.grad_scaler,
            accumulation_steps=config.accumulation_steps,
            on_layer_done=self._engine.layer_done,
            on_backward_end=self._engine.backward_end,
            timings=self._timings,
        )
        for f in self.factor_sizes():
            if f.dim > LARGE_FACTOR_DIM:
                warnings.warn(_large_factor_message(f), RuntimeWarning, stacklevel=2)
        logger.log(
            loglevel,
            "kaisa: registered %d layers: %s",
            len(self._layers),
            ", ".join(f"{n} ({type(la.module).__name__})" for n, la in self._layers.items()),
        )

    # ------------------------------------------------------------------ properties
    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._steps

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, at the current step."""
        return scheduled_int(
            "factor_update_steps", self._schedules["factor_update_steps"], self._steps
        )

    @property
    def inv_update_steps(self) -> int:
        """Steps between decomposition updates, at the current step."""
        return scheduled_int("inv_update_steps", self._schedules["inv_update_steps"], self._steps)

    @property
    def damping(self) -> float:
        """Damping at the current step."""
        return scheduled_float("damping", self._schedules["damping"], self._steps)

    @property
    def factor_decay(self) -> float:
        """Running-average decay ``rho`` at the current step."""
        return scheduled_float("factor_decay", self._schedules["factor_decay"], self._steps)

    @property
    def kl_clip(self) -> float | None:
        """KL-clip threshold at the current step (``None`` disables clipping)."""
        value = self._schedules["kl_clip"]
        return None if value is None else scheduled_float("kl_clip", value, self._steps)

    @property
    def lr(self) -> float:
        """Learning rate used by KL clipping, at the current step."""
        return scheduled_float("lr", self._schedules["lr"], self._steps)

    def schedule(self, name: str) -> Any:
        """The raw value of hyperparameter ``name``: a number, a callable or ``None``.

        Args:
            name: One of ``factor_update_steps``, ``inv_update_steps``, ``damping``,
                ``factor_decay``, ``kl_clip``, ``lr``.

        Raises:
            ValueError: For another name.
        """
        if name not in self._schedules:
            raise ValueError(f"unknown hyperparameter {name!r}; expected one of {HYPERPARAMETERS}")
        return self._schedules[name]

    def set_schedule(self, name: str, value: Any) -> None:
        """Replaces hyperparameter ``name`` (a number or a callable of the step).

        The value is checked like the constructor argument; checkpoints save it when it
        is a number. :class:`kaisa.scheduler.LambdaParamScheduler` uses this.

        Args:
            name: The hyperparameter (see :meth:`schedule`).
            value: Its new value.

        Raises:
            ValueError: For an unknown name or an invalid value.
        """
        self.schedule(name)
        KFACConfig(**{name: value})  # validates exactly like the constructor
        self._schedules[name] = value

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimisation step."""
        return self._config.accumulation_steps

    @property
    def compute_method(self) -> ComputeMethod:
        """Eigen or inverse."""
        return self._config.compute_method

    @property
    def assignment_strategy(self) -> AssignmentStrategy:
        """Cost model for placing decompositions."""
        return self._config.assignment_strategy

    @property
    def grad_worker_fraction(self) -> float:
        """Fraction of ranks that are gradient workers for each layer (1 at world size 1)."""
        return float(self._engine.grid.fraction)

    @property
    def distributed_strategy(self) -> DistributedStrategy | float | str:
        """The ``grad_worker_fraction`` argument as parsed (``'auto'`` stays ``'auto'``)."""
        return self._config.grad_worker_fraction

    @property
    def placement(self) -> Placement:
        """Which rank computes and broadcasts each layer's decompositions and gradient."""
        return self._engine.placement

    @property
    def rank(self) -> int:
        """This process's rank (0 without torch.distributed)."""
        return self._engine.rank

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the K-FAC work (1 without torch.distributed)."""
        return self._engine.world_size

    @property
    def config(self) -> KFACConfig:
        """The validated configuration."""
        return self._config

    @property
    def communicator(self) -> Communicator:
        """The communicator (its ``stats`` count bytes sent and time waited)."""
        return self._engine.communicator

    @property
    def factor_dtype(self) -> torch.dtype | None:
        """Factor dtype (``None``: the activations', at least float32)."""
        return self._config.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype:
        """Storage dtype of decompositions."""
        return self._config.inv_dtype

    @property
    def layers(self) -> dict[str, KFACLayer]:
        """Registered layers by module name."""
        return dict(self._layers)

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative host seconds by phase (on CUDA, launch time unless synchronised)."""
        return dict(self._timings)

    def reset_timings(self) -> None:
        """Zero :attr:`timings` (in place: the engine and the hooks add to the same dict)."""
        for key in self._timings:
            self._timings[key] = 0.0

    @property
    def skipped_factor_updates(self) -> int:
        """Per-batch factors not folded in because they were non-finite (syncs once)."""
        counts = [
            t
            for la in self._layers.values()
            for t in (la.factors.skipped_a, la.factors.skipped_g)
            if t is not None
        ]
        if not counts:
            return 0
        total = torch.stack([c.to("cpu", non_blocking=False) for c in counts]).sum()
        return int(total.item())

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Update factors/decompositions as scheduled and precondition every ``.grad``.

        Call after ``loss.backward()`` (after ``scaler.unscale_(optimizer)`` with AMP) and
        before ``optimizer.step()``.
        """
        steps = self._steps
        if steps % self.factor_update_steps == 0:
            with self._timed("factors"):
                self._update_factors(self.factor_decay)
        if steps % self.inv_update_steps == 0:
            with self._timed("decompositions"):
                self._engine.update_decompositions(self.damping)
        with self._timed("preconditioning"):
            pairs = self._engine.preconditioned_gradients(self.damping)
            write_preconditioned(pairs, kl_clip=self.kl_clip, lr=self.lr)
        self._steps += 1
        self._recorder.end_step()

    def discard_step(self) -> None:
        """Forgets what the hooks recorded since the last :meth:`step` (no step follows).

        For a step abandoned after its forward pass (e.g. a non-finite loss), so its
        statistics do not leak into the next step's factors. Call it on every rank, before
        any backward pass of the abandoned step.
        """
        for layer in self._layers.values():
            layer.stats.take()
            layer.stats.saved_inputs.clear()
            layer.stats.saved_grads.clear()
        self._recorder.end_step()

    def _update_factors(self, rho: float) -> None:
        """Averages the step's batch factors over ranks, then folds them in."""
        self._recorder.compute_saved()
        recorded = False
        for name, (a_batch, g_batch) in self._engine.averaged_factors().items():
            self._layers[name].factors.fold(a_batch, g_batch, rho)
            recorded = recorded or a_batch is not None or g_batch is not None
        if recorded:
            self._warn_silent_layers()

    def _warn_silent_layers(self) -> None:
        for name, layer in self._layers.items():
            if layer.a is None and layer.g is None and name not in self._warned_silent:
                self._warned_silent.add(name)
                msg = (
                    f"kaisa: the hooks of registered layer {name!r} "
                    f"({type(layer.module).__name__}) did not fire (is it called "
                    "functionally, like nn.MultiheadAttention.out_proj?); it is left "
                    "unpreconditioned until they do"
                )
                warnings.warn(msg, RuntimeWarning, stacklevel=4)
                logger.warning(msg)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """Everything a step reads: steps, non-callable hyperparameters, factors, decompositions.

        Args:
            include_factors: include per-layer factors and decompositions.
        """
        state: dict[str, Any] = {"steps": self._steps}
        for name, value in self._schedules.items():
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = {n: la.state_dict() for n, la in self._layers.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` output.

        Args:
            state_dict: the saved state.
            compute_inverses: recompute decompositions from the factors for layers saved
                without them (saved decompositions are always restored as they were, so a
                resumed run continues bit for bit).

        Raises:
            ValueError: if the state is malformed or names other layers.
        """
        if "steps" not in state_dict:
            raise ValueError("state_dict has no 'steps' entry; not a kaisa state dict")
        layers = state_dict.get("layers")
        if layers is not None:
            missing = set(self._layers) - set(layers)
            extra = set(layers) - set(self._layers)
            if missing or extra:
                raise ValueError(
                    "state_dict layers do not match the registered layers: "
                    f"missing {sorted(missing)}, unexpected {sorted(extra)}"
                )
        self._steps = int(state_dict["steps"])
        for name in HYPERPARAMETERS:
            if name in state_dict and not callable(self._schedules[name]):
                self._schedules[name] = state_dict[name]
        if layers is None:
            return
        for name, layer in self._layers.items():
            layer.load_state_dict(layers[name])
            if not self._engine.is_grad_worker(name):
                layer.decomposition.clear()
        need = any(
            la.a is not None and not la.has_decomposition() and self._engine.is_grad_worker(name)
            for name, la in self._layers.items()
        )
        need = self._engine.any_rank(need)  # every rank takes part in the broadcasts
        if compute_inverses and need:
            self._engine.update_decompositions(self.damping)

    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank K-FAC memory for every valid ``grad_worker_fraction``.

        This is the model ``grad_worker_fraction='auto'`` uses: an upper bound of what
        :meth:`memory_usage` reports, since it includes the per-step buffers (batch
        factors awaiting their allreduce, received preconditioned gradients).

        Returns:
            ``fraction -> estimate``, largest fraction (least communication) first.
        """
        return self._engine.memory_estimates()

    def factor_sizes(self) -> list[FactorSize]:
        """Every factor's dimension, memory and decomposition cost, largest first."""
        return self._engine.factor_sizes()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank by kind, plus ``'total'``.

        ``decompositions`` counts only the layers this rank is a gradient worker for (all
        of them with COMM-OPT, its own with MEM-OPT); ``buffers`` includes batch factors
        held until the next :meth:`step`.
        """
        usage = {"factors": 0, "decompositions": 0, "buffers": 0}
        for layer in self._layers.values():
            for key, value in layer.memory_usage().items():
                usage[key] += value
        usage["total"] = sum(usage.values())
        return usage

    @contextmanager
    def recording_g(self, enabled: bool, *, passes: int = 1) -> Iterator[None]:
        """Whether backward passes inside the block record G factors.

        :class:`kaisa.KFAC` records G from sampled targets (``passes`` backward passes per
        forward, one per Monte-Carlo sample) and not from the true loss's backward.

        Args:
            enabled: Record output gradients in the block.
            passes: Backward passes per recorded forward in the block.
        """
        recorder = self._recorder
        previous = (recorder.record_g, recorder.g_passes)
        recorder.record_g, recorder.g_passes = enabled, passes
        try:
            yield
        finally:
            recorder.record_g, recorder.g_passes = previous

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model's modules."""
        self._recorder.remove()

    def __repr__(self) -> str:
        def show(value: object) -> str:
            return "<callable>" if callable(value) else repr(value)

        args, fraction = self._config, self._config.grad_worker_fraction
        fields = {
            "layers": len(self._layers),
            "steps": self._steps,
            "compute_method": args.compute_method.value,
            **{name: show(value) for name, value in self._schedules.items()},
            "accumulation_steps": args.accumulation_steps,
            "grad_worker_fraction": (
                fraction.name if isinstance(fraction, DistributedStrategy) else repr(fraction)
            ),
            "inv_dtype": args.inv_dtype,
            "factor_dtype": args.factor_dtype,
        }
        body = ",\n".join(f"  {k}={v}" for k, v in fields.items())
        return f"{type(self).__name__}(\n{body},\n)"

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[key] += time.perf_counter() - start


def _large_factor_message(f: FactorSize) -> str:
    """The warning for a factor above :data:`~kaisa.distributed.LARGE_FACTOR_DIM`."""
    blocks = f" x {f.blocks} groups" if f.blocks > 1 else ""
    return (
        f"kaisa: layer {f.layer!r} has a {f.dim}x{f.dim}{blocks} {f.side} factor: about "
        f"{f.nbytes / 2**20:.0f} MB (running and batch factor, decomposition) and "
        f"{f.gflop:.0f} GFLOP per decomposition (every inv_update_steps steps), likely most "
        f"of each step. Leave it out with skip_layers=[{('^' + re.escape(f.layer) + '$')!r}] "
        "or make the layer smaller"
    )
