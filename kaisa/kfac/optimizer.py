"""``kaisa.KFAC``: the K-FAC optimizer with Monte-Carlo Fisher and the quadratic model.

Martens & Grosse 2015 and kfac-jax's adaptive optimizer, on the curvature core
(:class:`~kaisa.core.curvature.KFACCurvature`: every KAISA strategy works). :meth:`KFAC.step`
is a list of named phases: loss and curvature (G from sampled targets or the true loss),
direction (the preconditioned gradient), coefficients (the quadratic model,
:mod:`kaisa.kfac.quadratic`, or fixed ``lr``/``momentum``), apply, adapt damping (the
Levenberg-Marquardt rule). ``docs/conventions.md`` ("The adaptive step of
``kaisa.KFAC``") has the math and the cost; losses are :mod:`kaisa.kfac.losses`, loss
scaling :mod:`kaisa.kfac.amp`, the configuration :class:`~kaisa.kfac.config.KFACOptimizerConfig`.

In distributed runs (gradients averaged by DDP) the few scalars of the quadratic model
and of the LM rule are averaged over ranks, so every rank takes the same step.

The adaptive parts need the batch: :meth:`KFAC.step` takes a closure (:mod:`kaisa.kfac.closure`).
Without one (after the user's own ``loss.backward()``), only fixed ``lr``/``momentum`` with
``'empirical'`` curvature work. Mixed precision: ``torch.autocast`` inside the closure and a
``torch.amp.GradScaler`` as ``grad_scaler``; KFAC drives it (:mod:`kaisa.kfac.amp`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kaisa.core.checkpoint import KFACState
from kaisa.core.clipping import grouped_parameter_directions, write_directions
from kaisa.core.curvature import KFACCurvature
from kaisa.core.recording import ArmPlan
from kaisa.distributed.config import DistributedConfig
from kaisa.kfac import quadratic
from kaisa.kfac import state as optimizer_state
from kaisa.kfac.amp import HALF, full_precision_outputs
from kaisa.kfac.closure import Closure, call, replayed_loss
from kaisa.kfac.config import (
    ADAPTIVE,
    Curvature,
    FirstOrder,
    JacobianMethod,
    KFACOptimizerConfig,
    StepSize,
)
from kaisa.kfac.fisher import backward_passes
from kaisa.kfac.losses import Loss, LossKind, Reduction, Share
from kaisa.kfac.quadratic import lm_damping
from kaisa.kfac.replay import RandomState, replayed
from kaisa.utils.first_order import fixed_value, sgd_update
from kaisa.utils.hyperparams import Schedules
from kaisa.utils.profiling import phase, timed
from kaisa.utils.shards import is_sharded

__all__ = ["KFAC", "Curvature", "lm_damping"]

_PHASES = ("loss_and_grad", "precondition", "quadratic_model", "damping", "update")
#: The core's schedules KFAC evaluates (numbers or callables of the step).
_SCHEDULES = ("factor_update_steps", "inv_update_steps", "factor_decay", "kl_clip")


class KFAC(torch.optim.Optimizer):
    """K-FAC optimizer (see the module docstring for the algorithm).

    Args:
        model: The model; its blocks (``layer_kinds``: Linear, Conv2d, Conv1d and
            ``nn.MultiheadAttention`` projections by default)
            are preconditioned, every other trainable parameter follows ``first_order``.
        loss: ``'mse'`` or ``'cross_entropy'`` (``torch.nn.functional``'s).
        reduction: ``'mean'`` or ``'sum'``.
        curvature: ``'mc'`` (sampled targets, the default), ``'type2'`` (their
            expectation: one backward pass per output column, for small output
            dimensions) or ``'empirical'`` (``docs/conventions.md``).
        jvp: How the quadratic model gets ``J v``: ``'forward'`` (forward-mode AD over
            a replayed forward pass of the closure; works with every attention kernel)
            or ``'double_backward'`` (over the training graph).
        mc_samples: Monte-Carlo samples per factor update.
        lr: A number, a callable of the step, or ``'adaptive'``.
        momentum: A number, a callable of the step, or ``'adaptive'``.
        damping: Initial damping ``lambda`` (> 0).
        adaptive_damping: Adapt ``lambda`` with the Levenberg-Marquardt rule (with
            ``lr='adaptive'`` only: the rule compares with the quadratic model's prediction).
        damping_interval: Steps between LM adaptations.
        damping_decay: ``omega = damping_decay ** damping_interval``.
        min_damping: Lower bound of ``lambda``.
        max_damping: Upper bound of ``lambda``.
        weight_decay: L2 coefficient, part of the objective.
        seed: Seed of the Monte-Carlo target sampler.
        grad_scaler: A ``torch.amp.GradScaler`` for mixed precision (KFAC drives it; see
            the module docstring), or ``None``.
        first_order: Builds the optimizer of the parameters no block covers (:meth:`coverage`;
            default ``AdamW(lr=1e-3)``; a fixed lr steps every parameter with SGD); it steps
            after the K-FAC update and its damping rule, on the raw gradients.
        max_momentum: Keep the adaptive momentum in ``[0, max_momentum]`` (the lr is then
            the model's minimiser given it); ``None``: unconstrained (kfac-jax's rule).
        distributed: The distributed settings (``grad_worker_fraction``, ...) as one
            :class:`~kaisa.DistributedConfig`, as every product takes them (not with
            those keywords in ``preconditioner`` too).
        **preconditioner: Further :class:`~kaisa.KFACPreconditioner` arguments
            (``factor_update_steps``, ``inv_update_steps``, ``factor_decay``, ``kl_clip``
            for the fixed mode, ``grad_worker_fraction``, ...).

    Raises:
        ValueError: For invalid arguments (naming them).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss: LossKind | str,
        reduction: Reduction | str = Reduction.MEAN,
        curvature: Curvature | str = Curvature.MC,
        jvp: JacobianMethod | str = JacobianMethod.FORWARD,
        mc_samples: int = 1,
        lr: StepSize | str = ADAPTIVE,
        momentum: StepSize | str = ADAPTIVE,
        damping: float = 1e-3,
        adaptive_damping: bool = True,
        damping_interval: int = 5,
        damping_decay: float = 0.9,
        min_damping: float = 1e-8,
        max_damping: float = 1e3,
        weight_decay: float = 0.0,
        seed: int = 0,
        grad_scaler: Any = None,
        first_order: FirstOrder | None = None,
        max_momentum: float | None = 1.0,
        distributed: DistributedConfig | None = None,
        **preconditioner: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model must be a torch.nn.Module (KFAC(model, loss=...), not "
                f"KFAC(model.parameters(), ...)), got {type(model).__name__}"
            )
        arguments = {k: v for k, v in locals().items() if k not in ("self", "model", "__class__")}
        self.config = config = KFACOptimizerConfig.of(**arguments)
        self.loss: Loss = config.loss
        self.damping = config.damping
        self.steps = 0
        self.last: dict[str, float] = {}
        #: Host seconds by phase of :meth:`step` (the core's own phases are in
        #: ``curvature.timings``).
        self.timings = dict.fromkeys(_PHASES, 0.0)
        self._generator = torch.Generator().manual_seed(seed)
        self._model = model
        params = [p for p in model.parameters() if p.requires_grad]
        defaults = {"lr": config.fixed("lr"), "momentum": config.fixed("momentum"),
                    "weight_decay": config.weight_decay}
        super().__init__(params, defaults)
        self.scaling = config.scaling
        self._reduced_precision = False
        self._schedules = Schedules({name: getattr(config.kfac, name) for name in _SCHEDULES})
        #: Every name of each parameter (before FSDP2 may swap the module attributes).
        self._names = quadratic.parameter_names(model)
        if (config.adaptive_lr and config.jvp is JacobianMethod.DOUBLE_BACKWARD
                and any(map(is_sharded, params))):
            raise ValueError(
                "kaisa.KFAC on a model FSDP2 shards needs jvp='forward' (the default): "
                "'double_backward' differentiates the parameters, which FSDP2 replaces "
                "by their all-gathered copies during the forward pass"
            )
        self.curvature = KFACCurvature(model, config.kfac, stacklevel=2, settings=config.settings())
        covered = {id(p) for b in self.curvature.blocks.values() for p in b.parameters()}
        rest: list[torch.Tensor] = [p for p in params if id(p) not in covered]
        rule = config.first_order_rule()
        #: The optimizer of the parameters no block covers (``None``: the fixed SGD step
        #: takes every parameter, or every parameter is covered).
        self.first_order = rule(rest) if rest and rule is not None else None
        self._first_order_ids = {id(p) for p in rest} if self.first_order else set()
        self._share = Share(self.curvature.engine.rank, self.curvature.engine.world_size)  # MC rows
        self._arm()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """One K-FAC step.

        Args:
            closure: Returns ``(outputs, targets)`` from a fresh forward pass of the
                model on the current batch (needed for ``'mc'`` and ``'type2'`` curvature
                and the adaptive modes). Without it, call ``loss.backward()`` first.

        Returns:
            The loss (detached) when a closure is given, else ``None``.

        Raises:
            TypeError: If the closure does not return ``(outputs, targets)``.
            ValueError: If its outputs carry no graph, the targets do not fit the loss, or
                ``'type2'`` curvature would take more backward passes than its limit.

        Whatever raises, the statistics the step recorded are dropped. A step whose
        gradient is not finite (with a finite loss) changes no parameter and warns.
        """
        try:
            self.curvature.resolve_arm()
            return self._step(closure)
        except BaseException:
            self.curvature.discard()  # the aborted forward leaks into no later step
            raise

    def _step(self, closure: Closure | None) -> torch.Tensor | None:
        cfg = self.config
        if closure is None and (cfg.adaptive_lr or cfg.curvature is not Curvature.EMPIRICAL):
            raise ValueError(
                "KFAC.step() needs a closure returning (outputs, targets) for "
                "curvature='mc' or 'type2', or lr='adaptive'"
            )
        adapt = cfg.adaptive_damping and self.steps % cfg.damping_interval == 0
        # replayed forward passes (J v, the LM rule) start from the step forward's state
        rng = RandomState.capture() if closure is not None and cfg.adaptive_lr else None
        outputs = loss = linearization = None
        if closure is not None:
            outputs, loss, linearization, diverged = self._loss_and_curvature(closure, rng)
            if diverged:
                return loss.detach()
        params = self._params()
        with timed(self.timings, "precondition"):
            skip = self.curvature.any_rank(self.scaling.unscale_non_finite(self, params))
            if skip:
                kind = self.scaling.skipped_step(self.steps)  # an overflow, or warned about
                self._update_curvature()  # consumes the step's statistics (non-finite G skipped)
            else:
                params = [p for p in params if id(p) not in self._first_order_ids]
                if cfg.adaptive_lr:
                    raw, directions = self._direction(params)
                else:
                    self._update_curvature()
                    write_directions(  # blocks of one shape stacked, as the preconditioner
                        self.curvature.precondition_grouped(self.damping),
                        kl_clip=self._schedules.optional("kl_clip", self.steps),
                        lr=self._current("lr"),
                    )
        if skip:
            self.last = {"lr": 0.0, "momentum": 0.0, "damping": self.damping, kind: 1.0}
        elif cfg.adaptive_lr:
            assert outputs is not None and loss is not None and closure is not None
            vectors = [directions]
            velocity = [self.state[p].get("velocity") for p in params]
            if cfg.adaptive_momentum and all(v is not None for v in velocity):
                vectors.append([v for v in velocity if v is not None])
            with timed(self.timings, "quadratic_model"):  # the model's minimiser, over ranks
                quad, lin, sq = self.quadratic_model(outputs, params, raw, vectors, linearization)
                coeffs, predicted, loss_before = quadratic.minimise_over_ranks(
                    self.curvature.mean_over_ranks, quad, lin, sq, loss, self.damping,
                    cfg.max_momentum)
                del vectors[len(coeffs):]  # momentum collinear with the direction was dropped
            with timed(self.timings, "update"):
                alpha, mu = quadratic.apply(params, vectors, coeffs, self.state)
                for group in self.param_groups:
                    group["lr"], group["momentum"] = -alpha, mu
            self.last = {"lr": -alpha, "momentum": mu, "damping": self.damping,
                         "predicted_change": predicted, "loss": loss_before}
            if adapt and rng is not None:
                with timed(self.timings, "damping"):
                    self._adapt_damping(closure, loss_before, predicted, rng)
        else:
            with timed(self.timings, "update"):
                self._sgd_update(params)
        if self.first_order is not None and not skip:
            with phase("first_order"):
                self.first_order.step()
        self._end_step()
        return None if loss is None else loss.detach()

    # ------------------------------------------------------------------ phases
    def _loss_and_curvature(
        self, closure: Closure, rng: RandomState | None
    ) -> tuple[torch.Tensor, torch.Tensor, quadratic.JacobianProducts | None, bool]:
        """The loss, the gradient and (on factor steps) the statistics of the batch.

        Returns ``(outputs, loss, linearization, diverged)``: the linearisation replays
        the closure (``jvp='forward'``) or, with ``'double_backward'``, the first
        Monte-Carlo pass builds ``J^T``; a non-finite loss on any rank diverges (nothing
        computed, the step's statistics dropped).
        """
        cfg, curvature, factor_step = self.config, self.curvature, self._due("factor_update_steps")
        linearization: quadratic.JacobianProducts | None = None
        forward_mode = cfg.adaptive_lr and cfg.jvp is JacobianMethod.FORWARD
        with timed(self.timings, "loss_and_grad"), torch.enable_grad():
            with phase("forward"):
                outputs, targets = call(closure)
            self._reduced_precision = outputs.dtype in HALF
            outputs = full_precision_outputs(outputs)
            loss = self.loss(outputs, targets)
            if curvature.any_rank(not bool(torch.isfinite(loss))):
                curvature.discard()  # diverged: no update, the caller sees the loss
                return outputs, loss, None, True
            keep = cfg.adaptive_lr and not forward_mode
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
            params = self._params()
            covered = [p for p in params if id(p) not in self._first_order_ids]
            if forward_mode:
                assert rng is not None
                linearization = quadratic.ForwardLinearization(
                    self._model, lambda: full_precision_outputs(closure()[0]), covered,
                    lambda: replayed(self._model, rng), self._names,
                )
            built = backward_passes(cfg, curvature, self.loss, self.scaling, outputs, loss,
                                    factor_step=factor_step, params=params, covered=covered,
                                    generator=self._generator, share=self._share, keep=keep)
            linearization = built if built is not None else linearization
        return outputs, loss, linearization, False

    def _due(self, schedule: str) -> bool:  # whether a step-count schedule fires this step
        return self.steps % self._schedules.integer(schedule, self.steps) == 0

    def _update_curvature(self) -> None:  # the core's updates, when due
        if self._due("factor_update_steps"):
            self.curvature.update_factors(self._schedules.real("factor_decay", self.steps))
        self.curvature.scheduled_decompositions(
            self.steps, self._schedules.integer("inv_update_steps", self.steps), self.damping)

    def _direction(self, params: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``g`` (+ weight decay) and the preconditioned direction (``g`` where none)."""
        wd = self.config.weight_decay
        raw = [_grad(p).add(p, alpha=wd) if wd else _grad(p) for p in params]
        self._update_curvature()
        grads = dict(zip(params, raw, strict=True))
        return raw, grouped_parameter_directions(  # blocks of one shape stacked
            self.curvature.precondition_grouped(self.damping, grads=grads), params, raw)

    def _adapt_damping(self, closure: Closure, before: float, predicted: float,
                       start: RandomState) -> None:
        """The LM rule on ``rho = (L(theta + delta) - L(theta)) / m0(delta)``."""
        cfg, after = self.config, replayed_loss(self._model, closure, self.loss, start)
        rho = ((float(self.curvature.mean_over_ranks(after[None])[0]) - before) / predicted
               if predicted < 0 else -math.inf)
        self.damping = lm_damping(self.damping, rho, cfg.omega, cfg.min_damping, cfg.max_damping)
        self.last["rho"] = rho

    def quadratic_model(
        self, outputs: torch.Tensor, params: list[torch.Tensor], raw: list[torch.Tensor],
        vectors: list[list[torch.Tensor]], linearization: quadratic.JacobianProducts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Q = V^T (C + (lambda + wd) I) V``, ``b = V^T g``, ``D = V^T V`` (float64).

        ``C``: the Gauss-Newton matrix on the batch behind ``outputs`` (linearised here
        unless ``linearization`` is given).
        """
        if linearization is None:
            with torch.enable_grad(), self.curvature.output_gradients(passes=0):
                linearization = quadratic.Linearization(outputs, params, None)
        return quadratic.quadratic_model(
            self.loss, outputs, linearization, raw, vectors,
            regularization=self.damping + self.config.weight_decay,
            unit_products=self._reduced_precision, mean=self.curvature.mean_over_ranks,
        )

    # ------------------------------------------------------------------ helpers
    def _end_step(self) -> None:
        self.scaling.update()
        self.steps += 1
        self.curvature.end_step()
        self._arm()

    def _arm(self) -> None:  # whether the coming forward passes record, when first needed
        def plan() -> ArmPlan:
            recording = self._due("factor_update_steps")
            # G's passes differentiate the hooked outputs only (kaisa.kfac.fisher.record_g)
            self.curvature.recorder.keep_outputs = (
                recording and self.config.curvature is not Curvature.EMPIRICAL)
            decay = self._schedules.real("factor_decay", self.steps) if recording else None
            return recording, decay

        self.curvature.recorder.keep_outputs = False
        self.curvature.arm_when_used(plan)

    def _params(self) -> list[torch.Tensor]:
        """The trainable parameters (one frozen after construction is skipped)."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _current(self, name: str) -> float:
        """The fixed ``lr``/``momentum`` of this step (:func:`.first_order.fixed_value`)."""
        return fixed_value(name, getattr(self.config, name), self.param_groups, self.steps)

    def _sgd_update(self, params: list[torch.Tensor]) -> None:
        """``torch.optim.SGD`` (momentum, weight decay after preconditioning), exactly."""
        lr, momentum = self._current("lr"), self._current("momentum")
        sgd_update(params, self.state, lr=lr, momentum=momentum,
                   weight_decay=self.config.weight_decay)
        self.last = {"lr": lr, "momentum": momentum, "damping": self.damping}

    def coverage(self) -> dict[str, str]:
        """``{parameter name: block kind or 'first-order'}`` for every trainable parameter."""
        return self.curvature.coverage()

    @property
    def preconditioner(self) -> KFACCurvature:
        """The curvature core under its former name (``layers``, ``timings``, ...)."""
        return self.curvature

    @property
    def grad_scaler(self) -> Any:
        """The grad scaler KFAC drives, or ``None``."""
        return self.scaling.scaler

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, *, gather: bool = False) -> dict[str, Any]:
        """Optimizer, curvature and sampler state (``gather``: see KFACPreconditioner's)."""
        state = super().state_dict()
        state["kaisa"] = optimizer_state.saved(
            steps=self.steps, damping=self.damping, schedules=self._schedules, gather=gather,
            curvature=self.curvature, generator=self._generator, first_order=self.first_order,
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (bit-exact resume).

        Everything is checked first (:func:`kaisa.kfac.state.checked`): a malformed
        or mismatched state raises ``ValueError`` and leaves the optimizer as it was.
        """
        saved = optimizer_state.checked(state_dict, schedules=self._schedules,
                                        curvature=self.curvature, param_groups=self.param_groups,
                                        first_order=self.first_order)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "kaisa"})
        self.damping, self.steps = saved.damping, saved.steps
        self._schedules.load_state_dict(saved.schedules)
        if saved.layers is not None:
            self.curvature.load_state_dict(saved.layers, damping=self.damping)
        self._generator.set_state(saved.generator)
        if self.first_order is not None and saved.first_order is not None:
            self.first_order.load_state_dict(saved.first_order)
        self._arm()

    def kfac_state_dict(self) -> KFACState:
        """Counters, damping and the sampler's state, as :mod:`kaisa.checkpoint` takes them."""
        extra = self.state_dict()["kaisa"]  # the blocks' tensors not copied: cheap
        counters = {k: v for k, v in extra.items() if k not in ("generator", "first_order")}
        counters["preconditioner"] = {k: v for k, v in extra["preconditioner"].items()
                                      if k != "layers"}
        return KFACState(counters=counters, generator=extra["generator"])

    def kfac_optimizers(self) -> dict[str, torch.optim.Optimizer | None]:
        """Its first-order optimizer (``None`` without one), for the uncovered parameters."""
        return {"first_order": self.first_order}

    def load_kfac_state_dict(self, state: KFACState) -> None:
        """Restores :meth:`kfac_state_dict` output, its ``layers`` and ``optimizers``."""
        inner = state.counters.get("preconditioner")
        extra = {**state.counters, "generator": state.generator, "preconditioner": {
            **(inner if isinstance(inner, dict) else {}), "layers": dict(state.layers)}}
        if "first_order" in state.optimizers:
            extra["first_order"] = state.optimizers["first_order"]
        self.load_state_dict({**state.optimizers.get("self", {}), "kaisa": extra})


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
