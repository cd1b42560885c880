"""The K-FAC preconditioner: kfac-pytorch's API around the curvature core.

:class:`KFACPreconditioner` owns the hyperparameter schedules and the step counter, runs
the core's phases (:class:`~kaisa.core.curvature.KFACCurvature`: factors, decompositions,
preconditioning) when they are due, and writes the preconditioned gradients back with
KL clipping (:mod:`kaisa.core.clipping`). See ``docs/architecture.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from kaisa.blocks import CurvatureBlock
from kaisa.core.checkpoint import KFACState
from kaisa.core.clipping import write_directions
from kaisa.core.config import HYPERPARAMETERS, REFERENCE_KINDS, KFACConfig
from kaisa.core.curvature import KFACCurvature
from kaisa.core.recording import ArmPlan
from kaisa.distributed import Communicator, DistributedConfig, FactorSize, MemoryEstimate, Placement
from kaisa.utils.enums import (
    AssignmentStrategy,
    BasisRefresh,
    ComputeMethod,
    DistributedStrategy,
    FactorStorage,
    KFACApprox,
)
from kaisa.utils.hyperparams import Schedule, Schedules, check_count
from kaisa.utils.optim_state import check_known

__all__ = ["KFACPreconditioner"]


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
    ``'auto'`` with ``memory_budget_mb`` and/or a ``cost_model``: ``docs/scaling.md``;
    these settings, kfac-pytorch's keywords, may be given together as
    ``distributed=kaisa.DistributedConfig(...)``, as every product takes them, but not both
    ways). Factors are averaged over ranks by fused asynchronous allreduces started from the
    backward hooks; each layer's decompositions are computed by the rank(s) the
    placement assigns and broadcast to the layer's
    gradient workers, which precondition the gradient and broadcast it to the other
    ranks. Gradients must already be averaged over ranks when :meth:`step` runs
    (DistributedDataParallel, or an explicit allreduce), and every rank must run the same
    layers in the same order. With one rank everything is local.

    Beyond kfac-pytorch's keywords: ``factor_storage='packed'`` keeps each running factor
    as its upper triangles (about half the bytes; ``docs/conventions.md``, "Packed
    factors"); ``decomposition_spread=k`` decomposes the blocks in ``k`` parts of about
    equal cost, each on its own steps of the ``inv_update_steps`` interval, so that no
    step decomposes every factor (``docs/conventions.md``, "Spread decompositions");
    ``basis_refresh='qr'`` warm-starts the eigenbases from the previous ones between full
    decompositions every ``eigh_every``-th decomposition step (``docs/conventions.md``,
    "Warm-started eigenbases"); and the other :class:`~kaisa.core.config.KFACConfig` fields.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule[int] = 1,
        inv_update_steps: Schedule[int] = 1,
        decomposition_spread: int = 1,
        basis_refresh: BasisRefresh | str = BasisRefresh.EIGH,
        eigh_every: int = 10,
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
        cost_model: Any = None,
        symmetry_aware: bool = False,
        grad_scaler: Any = None,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: str | list[str] | None = None,
        update_factors_in_hook: bool = True,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        factor_storage: FactorStorage | str = FactorStorage.DENSE,
        layer_kinds: str | tuple[str, ...] = REFERENCE_KINDS,
        cross_attention: str | list[str] | None = None,
        loglevel: int = logging.DEBUG,
        collective_timeout: float | None = None,
        distributed: DistributedConfig | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        arguments = locals()
        self._config = config = KFACConfig(**{k: arguments[k] for k in KFACConfig.keywords()})
        self._model = model
        # The hyperparameter schedules (checkpoints restore the non-callable ones).
        self._schedules = Schedules({name: getattr(config, name) for name in HYPERPARAMETERS})
        self._steps = 0
        self._curvature = KFACCurvature(model, config, stacklevel=2)
        self._arm()

    # ------------------------------------------------------------------ properties
    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far."""
        return self._steps

    @property
    def factor_update_steps(self) -> int:
        """Steps between factor updates, at the current step."""
        return self._schedules.integer("factor_update_steps", self._steps)

    @property
    def inv_update_steps(self) -> int:
        """Steps between decomposition updates, at the current step."""
        return self._schedules.integer("inv_update_steps", self._steps)

    @property
    def damping(self) -> float:
        """Damping at the current step."""
        return self._schedules.real("damping", self._steps)

    @property
    def factor_decay(self) -> float:
        """Running-average decay ``rho`` at the current step."""
        return self._schedules.real("factor_decay", self._steps)

    @property
    def kl_clip(self) -> float | None:
        """KL-clip threshold at the current step (``None`` disables clipping)."""
        return self._schedules.optional("kl_clip", self._steps)

    @property
    def lr(self) -> float:
        """Learning rate used by KL clipping, at the current step."""
        return self._schedules.real("lr", self._steps)

    def schedule(self, name: str) -> Any:
        """The raw value of hyperparameter ``name``: a number, a callable or ``None``.

        Args:
            name: One of ``factor_update_steps``, ``inv_update_steps``, ``damping``,
                ``factor_decay``, ``kl_clip``, ``lr``.

        Raises:
            ValueError: For another name.
        """
        if name not in HYPERPARAMETERS:
            raise ValueError(f"unknown hyperparameter {name!r}; expected one of {HYPERPARAMETERS}")
        return self._schedules.raw(name)

    def set_schedule(self, name: str, value: Any) -> None:
        """Replaces hyperparameter ``name`` (a number or a callable of the step).

        The value is checked like the constructor argument; checkpoints save it when it
        is a number. :class:`kaisa.preconditioner.scheduler.LambdaParamScheduler` uses this.

        Args:
            name: The hyperparameter (see :meth:`schedule`).
            value: Its new value.

        Raises:
            ValueError: For an unknown name or an invalid value.
        """
        self.schedule(name)
        KFACConfig(**{name: value})  # validates exactly like the constructor
        self._schedules.set(name, value)
        self._arm()

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
        return float(self._curvature.engine.grid.fraction)

    @property
    def distributed_strategy(self) -> DistributedStrategy | float | str:
        """The ``grad_worker_fraction`` argument as parsed (``'auto'`` stays ``'auto'``)."""
        return self._config.grad_worker_fraction

    @property
    def placement(self) -> Placement:
        """Which rank computes and broadcasts each layer's decompositions and gradient."""
        return self._curvature.engine.placement

    @property
    def rank(self) -> int:
        """This process's rank (0 without torch.distributed)."""
        return self._curvature.engine.rank

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the K-FAC work (1 without torch.distributed)."""
        return self._curvature.engine.world_size

    @property
    def config(self) -> KFACConfig:
        """The validated configuration, with the hyperparameters as they are now."""
        return dataclasses.replace(
            self._config, **{n: self._schedules.raw(n) for n in HYPERPARAMETERS}
        )

    @property
    def curvature(self) -> KFACCurvature:
        """The curvature core this preconditioner drives."""
        return self._curvature

    @property
    def communicator(self) -> Communicator:
        """The communicator (its ``stats`` count bytes sent and time waited)."""
        return self._curvature.engine.communicator

    @property
    def factor_dtype(self) -> torch.dtype | None:
        """Factor dtype (``None``: the activations', at least float32)."""
        return self._config.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype:
        """Storage dtype of decompositions."""
        return self._config.inv_dtype

    @property
    def layers(self) -> dict[str, CurvatureBlock]:
        """Registered layers (the core's curvature blocks) by module name."""
        return self._curvature.blocks

    def coverage(self) -> dict[str, str]:
        """``{parameter name: block kind or 'first-order'}`` for every trainable parameter.

        The preconditioner leaves first-order gradients as they are (see
        :meth:`kaisa.core.curvature.KFACCurvature.coverage`).
        """
        return self._curvature.coverage()

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative host seconds by phase (on CUDA, launch time unless synchronised)."""
        return self._curvature.timings

    def reset_timings(self) -> None:
        """Zero :attr:`timings`."""
        self._curvature.reset_timings()

    @property
    def skipped_factor_updates(self) -> int:
        """Per-batch factors not folded in because they were non-finite (syncs once).

        Under FSDP2 the counts of the factors this rank keeps (those it decomposes).
        """
        return self._curvature.skipped_factor_updates

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """Update factors/decompositions as scheduled and precondition every ``.grad``.

        Call after ``loss.backward()`` (after ``scaler.unscale_(optimizer)`` with AMP) and
        before ``optimizer.step()``.
        """
        curvature, steps = self._curvature, self._steps
        curvature.resolve_arm()
        if steps % self.factor_update_steps == 0:
            curvature.update_factors(self.factor_decay)
        curvature.scheduled_decompositions(steps, self.inv_update_steps, self.damping)
        directions = curvature.precondition_grouped(self.damping)
        with curvature.timed("preconditioning"):
            write_directions(directions, kl_clip=self.kl_clip, lr=self.lr)
        self._steps += 1
        curvature.end_step()
        self._arm()

    def discard_step(self) -> None:
        """Forgets what the hooks recorded since the last :meth:`step` (no step follows).

        For a step abandoned after its forward pass (e.g. a non-finite loss), so its
        statistics do not leak into the next step's factors. Call it on every rank, before
        any backward pass of the abandoned step.
        """
        self._curvature.discard()

    def _arm(self) -> None:
        """Tells the core whether the coming forward passes record statistics.

        Evaluated when the step first needs it (its first forward pass, or :meth:`step`),
        so a schedule is read at the steps that run (as kfac-pytorch reads it).
        """
        def plan() -> ArmPlan:
            recording = self._steps % self.factor_update_steps == 0
            return recording, self.factor_decay if recording else None

        self._curvature.arm_when_used(plan)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True, *, gather: bool = False) -> dict[str, Any]:
        """Everything a step reads: steps, non-callable hyperparameters, factors, decompositions.

        Args:
            include_factors: include per-layer factors and decompositions.
            gather: also the decompositions held by other ranks (MEM-OPT, HYBRID-OPT)
                and, under FSDP2, the running factors other ranks keep, so that loading
                the state resumes bit for bit; a collective: call it on every rank (then
                save one rank's). Without it this rank's decompositions (and under FSDP2
                its factors) only, and loading recomputes the others from the factors.
        """
        state: dict[str, Any] = {"steps": self._steps, **self._schedules.state_dict()}
        if include_factors:
            state["layers"] = self._curvature.state_dict(gather=gather)
        return state

    def load_state_dict(self, state_dict: dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` output.

        Args:
            state_dict: the saved state.
            compute_inverses: recompute decompositions from the factors for layers saved
                without them (saved decompositions are always restored as they were, so a
                resumed run continues bit for bit).

        Raises:
            ValueError: if the state is malformed or names other layers (a bad step count,
                hyperparameter, factor shape or a non-finite factor); nothing is loaded.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError("state_dict has no 'steps' entry; not a kaisa state dict")
        check_known("state_dict", state_dict, ("steps", "layers", *self._schedules.names()))
        loaded = {name: state_dict.get(name) for name in ("steps", *self._schedules.names())}
        self._curvature.check_same_on_ranks(loaded, what="loaded K-FAC state")
        if "steps" not in state_dict:
            raise ValueError("state_dict has no 'steps' entry; not a kaisa state dict")
        steps = check_count("steps", state_dict["steps"])  # everything checked, then loaded
        self._schedules.check_state_dict(state_dict)
        layers = state_dict.get("layers")
        if layers is not None:
            self._curvature.check_state_dict(layers)
        self._steps = steps
        self._schedules.load_state_dict(state_dict)
        self._arm()
        if layers is not None:
            self._curvature.load_state_dict(
                layers, damping=self.damping, compute_inverses=compute_inverses
            )

    def kfac_state_dict(self) -> KFACState:
        """Its counters, as :mod:`kaisa.checkpoint` takes them (no generator)."""
        return KFACState(counters=self.state_dict(include_factors=False))

    def kfac_optimizers(self) -> dict[str, torch.optim.Optimizer | None]:
        """None: the optimizer stepped after it is the user's, checkpointed as torch's."""
        return {}

    def load_kfac_state_dict(self, state: KFACState) -> None:
        """Restores :meth:`kfac_state_dict` output and ``state.layers`` (checked whole)."""
        self.load_state_dict({**state.counters, "layers": dict(state.layers)})

    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank K-FAC memory for every valid ``grad_worker_fraction``.

        This is the model ``grad_worker_fraction='auto'`` uses: an upper bound of what
        :meth:`memory_usage` reports, since it includes the per-step buffers (batch
        factors awaiting their allreduce, received preconditioned gradients).

        Returns:
            ``fraction -> estimate``, largest fraction (least communication) first.
        """
        return self._curvature.memory_estimates()

    def factor_sizes(self) -> list[FactorSize]:
        """Every factor's dimension, memory and decomposition cost, largest first."""
        return self._curvature.factor_sizes()

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank by kind, plus ``'total'``.

        ``decompositions`` counts only the layers this rank is a gradient worker for (all
        of them with COMM-OPT, its own with MEM-OPT); ``buffers`` includes batch factors
        held until the next :meth:`step`.
        """
        return self._curvature.memory_usage()

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model's modules."""
        self._curvature.remove_hooks()

    def __repr__(self) -> str:
        def show(value: object) -> str:
            return "<callable>" if callable(value) else repr(value)

        args, fraction = self._config, self._config.grad_worker_fraction
        fields = {
            "layers": len(self._curvature.blocks),
            "steps": self._steps,
            "compute_method": args.compute_method.value,
            **{name: show(self._schedules.raw(name)) for name in HYPERPARAMETERS},
            "accumulation_steps": args.accumulation_steps,
            "grad_worker_fraction": (
                fraction.name if isinstance(fraction, DistributedStrategy) else repr(fraction)
            ),
            "inv_dtype": args.inv_dtype,
            "factor_dtype": args.factor_dtype,
        }
        body = ",\n".join(f"  {k}={v}" for k, v in fields.items())
        return f"{type(self).__name__}(\n{body},\n)"
