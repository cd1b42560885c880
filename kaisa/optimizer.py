"""``kaisa.KFAC``: the K-FAC optimizer with Monte-Carlo Fisher and the quadratic model.

One step (Martens & Grosse 2015; kfac-jax's adaptive optimizer), on the engine of
:class:`~kaisa.KFACPreconditioner` (every KAISA strategy works):

1. **Curvature.** The forward records A factors. With ``curvature='mc'`` the G factors
   come from a backward pass of the loss at targets sampled from the model's predictive
   distribution (``mc_samples`` passes); with ``'empirical'`` from the true loss's
   backward pass. They are scaled so ``A (x) G`` approximates the Fisher of the declared
   loss (then ranks' factors average to the global batch's), except in the fixed-lr
   empirical mode, which keeps kfac-pytorch's convention (and equals
   ``KFACPreconditioner`` + SGD).
2. **Direction.** The true loss's gradient ``g`` (plus ``weight_decay * theta``) is
   preconditioned: ``Delta = (A (x) G + lambda I)^-1 g`` per registered layer, ``g`` itself
   elsewhere. The adaptive mode defaults to ``compute_method='pi_inverse'`` (kfac-jax's
   pi-adjusted factored damping: two Cholesky inverses per layer instead of two
   eigendecompositions), the fixed mode to ``KFACPreconditioner``'s ``'eigen'``.
3. **Step size.** Fixed ``lr``/``momentum``: SGD with momentum on ``Delta`` (exactly
   :class:`torch.optim.SGD` after ``KFACPreconditioner.step()``). ``'adaptive'``: the
   update ``delta = alpha Delta + mu delta_prev`` minimises the local quadratic model
   ``m(d) = g.d + 1/2 d.(C + (lambda + wd) I) d``, ``C`` the exact Gauss-Newton matrix of
   the loss on this batch: a 2 x 2 linear solve. ``lr = -alpha``, ``momentum = mu``.
   The Jacobian-vector products come from the double-backward trick: one backward pass
   with ``create_graph=True`` (which is also the first Monte-Carlo sample's pass, so it
   records G too), then one backward pass through it per vector.
4. **Damping.** Fixed, or every ``damping_interval`` steps the Levenberg-Marquardt rule on
   ``rho = (L(theta + delta) - L(theta)) / m0(delta)`` (one extra forward pass), ``m0`` the
   model without the damping term (Martens & Grosse 2015, 6.5; kfac-jax's default): ``lambda``
   is multiplied by ``omega = damping_decay ** damping_interval`` when ``rho > 3/4`` and
   divided by it when ``rho < 1/4``, within ``[min_damping, max_damping]``.

In distributed runs (gradients averaged by DDP) the few scalars of the quadratic model
and of the LM rule are averaged over ranks, so every rank takes the same step.

The adaptive parts need the batch: :meth:`KFAC.step` takes a closure returning
``(outputs, targets)`` from a fresh forward pass. Without a closure (after the user's own
``loss.backward()``), only fixed ``lr``/``momentum`` with ``'empirical'`` curvature work.
Mixed precision: run the forward pass under ``torch.autocast`` (inside the closure) and
pass a ``torch.amp.GradScaler`` as ``grad_scaler``. KFAC then owns the scaler: it scales
every backward pass, unscales the gradients, skips the update of a step whose gradients
overflowed (the factors of that step are skipped too) and updates the scale. Do not call
``scaler.step``/``scaler.update`` yourself; without a closure call
``scaler.scale(loss).backward()`` then ``opt.step()``. Losses and the quadratic model are
computed in float32 from half-precision outputs.

Cost of an adaptive step with ``'mc'`` curvature: one forward pass, the create-graph
backward pass, the true loss's backward pass and two backward passes for ``J Delta`` and
``J delta_prev`` (about 3x the autograd work of an SGD step), plus one forward pass every
``damping_interval`` steps for the LM rule.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kaisa.enums import parse_enum
from kaisa.finite import all_finite
from kaisa.hooks import loss_scale
from kaisa.losses import Loss, LossKind, Reduction
from kaisa.preconditioner import KFACPreconditioner

__all__ = ["KFAC", "Curvature"]

Closure = Callable[[], tuple[torch.Tensor, torch.Tensor]]
Schedule = float | Callable[[int], float]


class Curvature(enum.Enum):
    """Where the G factors come from."""

    EMPIRICAL = "empirical"
    MC = "mc"


ADAPTIVE = "adaptive"


class KFAC(torch.optim.Optimizer):
    """K-FAC optimizer (see the module docstring for the algorithm).

    Args:
        model: The model; its Linear and Conv2d layers are preconditioned, every other
            trainable parameter takes the plain gradient direction.
        loss: ``'mse'`` or ``'cross_entropy'`` (``torch.nn.functional``'s).
        reduction: ``'mean'`` or ``'sum'``.
        curvature: ``'mc'`` (sampled targets, the default) or ``'empirical'``.
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
        mc_samples: int = 1,
        lr: Schedule | str = ADAPTIVE,
        momentum: Schedule | str = ADAPTIVE,
        damping: float = 1e-3,
        adaptive_damping: bool = True,
        damping_interval: int = 5,
        damping_decay: float = 0.9,
        min_damping: float = 1e-8,
        max_damping: float = 1e3,
        weight_decay: float = 0.0,
        seed: int = 0,
        grad_scaler: Any = None,
        **preconditioner: Any,
    ) -> None:
        self.loss = Loss.of(loss, reduction)
        self.curvature = parse_enum(Curvature, curvature, "curvature")
        _check_positive_int("mc_samples", mc_samples)
        _check_positive_int("damping_interval", damping_interval)
        self.adaptive_lr = _is_adaptive("lr", lr)
        self.adaptive_momentum = _is_adaptive("momentum", momentum)
        if self.adaptive_momentum and not self.adaptive_lr:
            raise ValueError("momentum='adaptive' needs lr='adaptive'")
        for name, value, low in (("damping", damping, 0.0), ("min_damping", min_damping, 0.0),
                                 ("max_damping", max_damping, 0.0),
                                 ("damping_decay", damping_decay, 0.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > low
            ):
                raise ValueError(f"{name} must be a finite number > {low}, got {value!r}")
        if not damping_decay < 1:
            raise ValueError(f"damping_decay must be < 1, got {damping_decay!r}")
        if not min_damping <= damping <= max_damping:
            raise ValueError("damping must lie in [min_damping, max_damping]")
        if isinstance(weight_decay, bool) or not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        self.mc_samples = mc_samples
        self.damping_interval = damping_interval
        self.omega = damping_decay**damping_interval
        self.min_damping, self.max_damping = float(min_damping), float(max_damping)
        self.weight_decay = float(weight_decay)
        self._lr, self._momentum = lr, momentum
        self.damping = float(damping)
        self.steps = 0
        self.last: dict[str, float] = {}
        #: Host seconds by phase of :meth:`step` (the preconditioner's own phases are in
        #: ``preconditioner.timings``).
        self.timings = dict.fromkeys(("loss_and_grad", "precondition", "quadratic_model",
                                      "damping", "update"), 0.0)
        self._generator = torch.Generator().manual_seed(seed)
        self._model = model
        params = [p for p in model.parameters() if p.requires_grad]
        defaults = {
            "lr": math.nan if self.adaptive_lr or callable(lr) else float(lr),  # type: ignore[arg-type]
            "momentum": (
                math.nan if self.adaptive_momentum or callable(momentum) else float(momentum)  # type: ignore[arg-type]
            ),
            "weight_decay": self.weight_decay,
        }
        super().__init__(params, defaults)
        adaptive = self.adaptive_lr
        if adaptive and preconditioner.get("kl_clip") is not None:
            raise ValueError("kl_clip is for fixed lr; the quadratic model bounds the step")
        preconditioner.setdefault("kl_clip", None if adaptive else 0.001)
        # Adaptive mode: kfac-jax's pi-adjusted factored damping (two Cholesky inverses,
        # a quarter of the eigendecompositions' cost); fixed mode: KFACPreconditioner's.
        preconditioner.setdefault("compute_method", "pi_inverse" if adaptive else "eigen")
        # The LM rule needs the quadratic model's prediction, so damping adapts only with
        # the adaptive lr; a changing damping is applied at each step (no stale outer
        # product), a fixed one as KFACPreconditioner does by default.
        self.adaptive_damping = adaptive_damping and adaptive
        preconditioner.setdefault("compute_eigenvalue_outer_product", not self.adaptive_damping)
        if grad_scaler is not None and not all(
            hasattr(grad_scaler, m) for m in ("scale", "unscale_", "update", "get_scale")
        ):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler, got {grad_scaler!r}")
        self.grad_scaler = grad_scaler
        for reserved in ("damping", "lr"):
            if reserved in preconditioner:
                raise ValueError(f"{reserved} is set by KFAC, not a preconditioner argument")
        # Curvature scaled to the Fisher of the declared loss (so ranks' factors average to
        # the global batch's) for sampled targets and the adaptive mode; the fixed
        # empirical mode keeps kfac-pytorch's convention (= KFACPreconditioner).
        self._proper_scale = self.curvature is Curvature.MC or self.adaptive_lr
        self.preconditioner = KFACPreconditioner(
            model,
            damping=lambda _step: self.damping,
            # the KL clip (fixed mode only) bounds the step at the optimizer's current lr
            lr=lambda _step: 1.0 if self.adaptive_lr else self._current("lr"),
            grad_scaler=(
                self._g_divisor if self._proper_scale or grad_scaler is not None else None
            ),
            **preconditioner,
        )
        self._scale = 1.0
        self._linearization: _Linearization | None = None
        self._reduced_precision = False

    # ------------------------------------------------------------------ helpers
    def _current(self, name: str) -> float:
        """The fixed ``lr``/``momentum`` of this step.

        A callable's value, else the param group's (which LR schedulers may change).
        """
        schedule = self._lr if name == "lr" else self._momentum
        if callable(schedule):
            value = float(schedule(self.steps))
            for group in self.param_groups:
                group[name] = value
        value = float(self.param_groups[0][name])
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} at step {self.steps} is {value}, not a number >= 0")
        return value

    def _g_divisor(self) -> float | torch.Tensor:
        """What output gradients are divided by: the Fisher scale times the loss scale."""
        fisher = self._scale if self._proper_scale else 1.0
        if self.grad_scaler is None:
            return fisher
        scale = loss_scale(self.grad_scaler)  # float32 on the scaler; the product in float64
        return fisher * (scale.double() if isinstance(scale, torch.Tensor) else scale)

    def _scaler(self) -> Any:
        """The grad scaler when enabled, else ``None``."""
        scaler = self.grad_scaler
        if scaler is None or (hasattr(scaler, "is_enabled") and not scaler.is_enabled()):
            return None
        return scaler

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, in ``loss``'s dtype.

        ``scaler.scale(loss)`` would round a float64 loss to float32; scaling a one creates
        the scaler's scale tensor on first use all the same.
        """
        scaler = self._scaler()
        if scaler is None:
            return loss
        one = torch.ones((), dtype=torch.float32, device=loss.device)
        scale: torch.Tensor = scaler.scale(one)
        return loss * scale.to(loss.dtype).reshape(())

    def _unscale_overflowed(self, params: list[torch.Tensor]) -> bool:
        """Unscales the gradients (with a scaler); whether any is not finite."""
        scaler = self._scaler()
        if scaler is None:
            return False
        try:
            scaler.unscale_(self)
        except RuntimeError as err:
            raise ValueError(
                "KFAC drives its grad_scaler: call opt.step() (not scaler.step(opt)) and do "
                "not call scaler.unscale_(opt) or scaler.update()"
            ) from err
        grads = [p.grad for p in params if p.grad is not None]
        return bool(grads) and not bool(torch.stack([all_finite(g) for g in grads]).all())

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _allreduce(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a few float64 scalars, on their device (NCCL needs CUDA)."""
        comm = self.preconditioner.communicator
        if comm.world_size == 1:
            return values
        return comm.allreduce_mean(values, kind="control").wait()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Closure | None = None) -> torch.Tensor | None:  # type: ignore[override]
        """One K-FAC step.

        Args:
            closure: Returns ``(outputs, targets)`` from a fresh forward pass of the
                model on the current batch (needed for ``'mc'`` curvature and the adaptive
                modes). Without it, call ``loss.backward()`` first.

        Returns:
            The loss (detached) when a closure is given, else ``None``.
        """
        pre = self.preconditioner
        factor_step = pre.steps % pre.factor_update_steps == 0
        if closure is None:
            if self.adaptive_lr or self.curvature is Curvature.MC:
                raise ValueError(
                    "KFAC.step() needs a closure returning (outputs, targets) for "
                    "curvature='mc' or lr='adaptive'"
                )
            outputs = loss = None
        else:
            start = time.perf_counter()
            with torch.enable_grad():
                outputs, targets = closure()
                self._reduced_precision = outputs.dtype in _HALF
                outputs = _full(outputs)
                loss = self.loss(outputs, targets)
                if self._any_rank(not bool(torch.isfinite(loss))):
                    # diverged: no update, the caller sees the loss
                    pre.discard_step()
                    return loss.detach()
                keep = self.adaptive_lr
                params = self._params()
                for p in params:
                    p.grad = None
                if self._proper_scale:
                    self._scale = math.sqrt(
                        self.loss.scale(outputs) / self.loss.examples(outputs)
                    )
                self._linearization = None
                if self.curvature is Curvature.MC and factor_step and outputs.requires_grad:
                    with pre.recording_g(True, passes=self.mc_samples):
                        for sample in range(self.mc_samples):
                            targets_mc = self.loss.sample_targets(outputs, self._generator)
                            if sample == 0 and keep:
                                # this pass records G and builds J^T for the quadratic model;
                                # the seed is taken off the graph (no layer hook fires twice)
                                free = outputs.detach().requires_grad_(True)
                                sampled = self._scaled(self.loss(free, targets_mc))
                                (seed,) = torch.autograd.grad(sampled, free)
                                self._linearization = _Linearization(outputs, params, seed)
                            else:
                                sampled = self._scaled(self.loss(outputs, targets_mc))
                                torch.autograd.grad(sampled, params, retain_graph=True,
                                                    allow_unused=True)
                    with pre.recording_g(False):
                        torch.autograd.backward(self._scaled(loss), retain_graph=keep)
                else:
                    torch.autograd.backward(self._scaled(loss), retain_graph=keep)
            self.timings["loss_and_grad"] += time.perf_counter() - start
        params = self._params()
        start = time.perf_counter()
        if self._unscale_overflowed(params):  # AMP: no update this step, a smaller scale
            self._linearization = None
            pre.step()  # consumes the step's statistics (its non-finite G is skipped)
            self.timings["precondition"] += time.perf_counter() - start
            self.last = {"lr": 0.0, "momentum": 0.0, "damping": self.damping, "overflow": 1.0}
            self._end_step()
            return None if loss is None else loss.detach()
        if self.adaptive_lr:
            grads = [_grad(p) for p in params]
            if self.weight_decay:
                for p, g in zip(params, grads, strict=True):
                    g.add_(p, alpha=self.weight_decay)
            raw = [g.clone() for g in grads]
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            pre.step()
            self.timings["precondition"] += time.perf_counter() - start
            directions = [_grad(p) for p in params]
            assert outputs is not None and loss is not None
            self._adaptive_update(params, raw, directions, outputs, loss, closure)
        else:
            pre.step()
            self.timings["precondition"] += time.perf_counter() - start
            start = time.perf_counter()
            self._sgd_update(params)
            self.timings["update"] += time.perf_counter() - start
        self._end_step()
        return None if loss is None else loss.detach()

    def _end_step(self) -> None:
        scaler = self._scaler()
        if scaler is not None:
            scaler.update()
        self.steps += 1

    def _any_rank(self, flag: bool) -> bool:
        """Logical or over ranks (every rank must take the same branch)."""
        if self.preconditioner.communicator.world_size == 1:
            return flag
        device = next(iter(self.preconditioner.layers.values())).weight.device
        return bool(self._allreduce(torch.tensor([float(flag)], device=device))[0] > 0)

    def _sgd_update(self, params: list[torch.Tensor]) -> None:
        """``torch.optim.SGD`` (momentum, weight decay after preconditioning), exactly."""
        lr, momentum = self._current("lr"), self._current("momentum")
        for p in params:
            if p.grad is None:
                continue
            d_p = p.grad
            if self.weight_decay:
                d_p = d_p.add(p, alpha=self.weight_decay)
            if momentum:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = torch.clone(d_p).detach()
                    state["momentum_buffer"] = buf
                else:
                    buf.mul_(momentum).add_(d_p)
                d_p = buf
            p.add_(d_p, alpha=-lr)
        self.last = {"lr": lr, "momentum": momentum, "damping": self.damping}

    def quadratic_model(
        self,
        outputs: torch.Tensor,
        params: list[torch.Tensor],
        raw: list[torch.Tensor],
        vectors: list[list[torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Q_ij = v_i.(C + (lambda + wd) I) v_j``, ``b_i = g.v_i`` and ``D_ij = v_i.v_j``.

        ``C`` is the Gauss-Newton matrix of the loss on the batch behind ``outputs``; all
        three are float64.
        """
        linearization, self._linearization = self._linearization, None
        if linearization is None:
            with torch.enable_grad(), self.preconditioner.recording_g(False):
                linearization = _Linearization(outputs, params, None)
        k = len(vectors)
        gram = _gram([raw, *vectors])  # [g, v_1, ..., v_k] pairwise dot products
        # half-precision graphs: J v of unit vectors, scaled back (no over/underflow)
        norms = gram.diagonal()[1:].sqrt().tolist() if self._reduced_precision else None
        jvs = linearization.jacobian_vector_products(vectors, norms)
        quad = torch.empty(k, k, dtype=torch.float64, device=outputs.device)
        reg = self.damping + self.weight_decay
        for i in range(k):
            for j in range(i, k):
                value = self.loss.gauss_newton(outputs, jvs[i], jvs[j])
                quad[i, j] = quad[j, i] = value + reg * gram[i + 1, j + 1]
        return quad, gram[0, 1:].clone(), gram[1:, 1:].clone()

    def _adaptive_update(
        self,
        params: list[torch.Tensor],
        raw: list[torch.Tensor],
        directions: list[torch.Tensor],
        outputs: torch.Tensor,
        loss: torch.Tensor,
        closure: Closure | None,
    ) -> None:
        velocity = [self.state[p].get("velocity") for p in params]
        with_momentum = self.adaptive_momentum and all(v is not None for v in velocity)
        vectors = [directions]
        if with_momentum:
            vectors.append([v for v in velocity if v is not None])
        start = time.perf_counter()
        quad, lin, sq = self.quadratic_model(outputs, params, raw, vectors)
        reduced = self._allreduce(torch.cat([quad.flatten(), lin, loss.detach().double()[None]]))
        k = len(vectors)
        quad, lin = reduced[: k * k].view(k, k), reduced[k * k : k * k + k]
        loss_before = float(reduced[-1])
        coeffs = _solve(quad, lin)
        if coeffs is None and k > 1:  # momentum collinear with the direction: drop it
            k, vectors = 1, vectors[:1]
            quad, lin, sq = quad[:1, :1], lin[:1], sq[:1, :1]
            coeffs = _solve(quad, lin)
        if coeffs is None:  # degenerate model: take no step this time
            coeffs = torch.zeros(k, dtype=torch.float64, device=quad.device)
        alpha = float(coeffs[0])
        mu = float(coeffs[1]) if k > 1 else 0.0
        # The LM rule compares with the undamped model (weight decay is part of the
        # objective, the damping is not): Martens & Grosse 2015, 6.5; kfac-jax's default.
        undamped = quad - self.damping * sq.to(quad.device)
        predicted = float(0.5 * coeffs @ undamped @ coeffs + lin @ coeffs)
        self.timings["quadratic_model"] += time.perf_counter() - start
        start = time.perf_counter()
        for i, p in enumerate(params):
            step = directions[i].mul(alpha)
            if k > 1:
                step.add_(vectors[1][i], alpha=mu)
            p.add_(step)
            self.state[p]["velocity"] = step
        for group in self.param_groups:
            group["lr"], group["momentum"] = -alpha, mu
        self.timings["update"] += time.perf_counter() - start
        self.last = {"lr": -alpha, "momentum": mu, "damping": self.damping,
                     "predicted_change": predicted, "loss": loss_before}
        adapt = self.adaptive_damping and self.steps % self.damping_interval == 0
        if adapt and closure is not None:
            start = time.perf_counter()
            with torch.no_grad():
                after_outputs, after_targets = closure()
                after = self.loss(_full(after_outputs), after_targets).detach().double()
            loss_after = float(self._allreduce(after[None])[0])
            rho = (loss_after - loss_before) / predicted if predicted < 0 else -math.inf
            self.damping = lm_damping(self.damping, rho, self.omega, self.min_damping,
                                      self.max_damping)
            self.last["rho"] = rho
            self.timings["damping"] += time.perf_counter() - start

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state plus the preconditioner's, the damping and the sampler."""
        state = super().state_dict()
        state["kaisa"] = {
            "preconditioner": self.preconditioner.state_dict(),
            "damping": self.damping,
            "steps": self.steps,
            "generator": self._generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` output (bit-exact resume)."""
        extra = dict(state_dict)["kaisa"]
        rest = {k: v for k, v in state_dict.items() if k != "kaisa"}
        super().load_state_dict(rest)
        self.preconditioner.load_state_dict(extra["preconditioner"])
        self.damping = float(extra["damping"])
        self.steps = int(extra["steps"])
        self._generator.set_state(extra["generator"])


def lm_damping(damping: float, rho: float, omega: float, low: float, high: float) -> float:
    """The Levenberg-Marquardt rule: shrink when the model fits, grow when it does not.

    Args:
        damping: The current damping.
        rho: Actual over predicted loss change.
        omega: The factor (< 1).
        low: Lower bound.
        high: Upper bound.

    Returns:
        ``damping * omega`` if ``rho > 3/4``, ``damping / omega`` if ``rho < 1/4``
        (also for a non-finite ``rho``), else ``damping``; clamped to ``[low, high]``.
    """
    if not math.isfinite(rho) or rho < 0.25:
        damping = damping / omega
    elif rho > 0.75:
        damping = damping * omega
    return min(high, max(low, damping))


def _solve(quad: torch.Tensor, lin: torch.Tensor) -> torch.Tensor | None:
    """Minimiser ``-Q^-1 b`` of ``1/2 c.Q c + b.c``; ``None`` if ``Q`` is not positive."""
    if not bool(torch.isfinite(quad).all() and torch.isfinite(lin).all()):
        return None
    eigenvalues = torch.linalg.eigvalsh(quad)
    if not bool(eigenvalues.min() > 0):
        return None
    solution: torch.Tensor = -torch.linalg.solve(quad, lin)
    return solution


class _Linearization:
    """``J^T u`` as a differentiable function of ``u``, for ``J v`` (double-backward trick).

    ``J`` is the Jacobian of ``outputs`` w.r.t. ``params``. One backward pass with
    ``create_graph=True`` builds ``t(u) = J^T u``; since ``t`` is linear in ``u``, the
    gradient of ``t . v`` w.r.t. ``u`` is ``J v`` whatever ``u``'s value. A sampled
    loss's output gradient as ``u`` lets that pass also record the Monte-Carlo G factors
    (one backward pass fewer per step).

    Args:
        outputs: The model outputs (with their graph).
        params: The parameters.
        seed: The value of ``u`` (zeros if ``None``).
    """

    def __init__(
        self, outputs: torch.Tensor, params: list[torch.Tensor], seed: torch.Tensor | None
    ) -> None:
        seed = torch.zeros_like(outputs) if seed is None else seed.detach()
        self.dummy = seed.requires_grad_(True)
        transposed = torch.autograd.grad(
            outputs, params, grad_outputs=self.dummy, create_graph=True, allow_unused=True
        )
        self.used = [i for i, t in enumerate(transposed) if t is not None]
        self.transposed = [transposed[i] for i in self.used]

    def jacobian_vector_products(
        self, vectors: list[list[torch.Tensor]], norms: list[float] | None = None
    ) -> list[torch.Tensor]:
        """``J v`` per vector (one tensor per parameter); frees the graph after the last.

        With ``norms``, ``J (v / |v|)`` is computed and multiplied by ``|v|``.
        """
        out = []
        with torch.enable_grad():
            for n, v in enumerate(vectors):
                norm = 1.0 if norms is None or not norms[n] > 0 else norms[n]
                (jv,) = torch.autograd.grad(
                    self.transposed, self.dummy,
                    grad_outputs=[v[i] if norm == 1.0 else v[i] / norm for i in self.used],
                    retain_graph=n < len(vectors) - 1,
                )
                out.append(jv.detach() if norm == 1.0 else jv.detach() * norm)
        return out


def _gram(vectors: list[list[torch.Tensor]]) -> torch.Tensor:
    """Dot products ``vectors[i] . vectors[j]`` (over all parameters), float64."""
    k = len(vectors)
    device = vectors[0][0].device
    gram = torch.zeros(k, k, dtype=torch.float64, device=device)
    for parts in zip(*vectors, strict=True):
        rows = torch.stack([t.reshape(-1) for t in parts]).double()
        gram.add_(rows @ rows.T)
    return gram


_HALF = (torch.float16, torch.bfloat16)


def _full(outputs: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs (autocast) as float32, for the loss and the quadratic model."""
    return outputs.float() if outputs.dtype in _HALF else outputs


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _is_adaptive(name: str, value: object) -> bool:
    if isinstance(value, str):
        if value.strip().lower() != ADAPTIVE:
            raise ValueError(f"{name} must be a number, a callable or 'adaptive', got {value!r}")
        return True
    if callable(value):
        return False
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
        value
    ) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, a callable or 'adaptive', got {value!r}")
    return False


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
