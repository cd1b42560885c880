"""The K-FAC preconditioner: registers layers, records statistics, preconditions grads.

Arguments are validated in :mod:`kaisa.arguments`, math lives in :mod:`kaisa.factors` and
:mod:`kaisa.linalg`, kernels in :mod:`kaisa.ops`, per-layer state in :mod:`kaisa.layers`
and the distribution over ranks in :mod:`kaisa.distributed.engine`; this module
orchestrates them step by step.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from kaisa import linalg
from kaisa.arguments import (
    HYPERPARAMETERS,
    loss_scale,
    parse_arguments,
    scheduled_float,
    scheduled_int,
)
from kaisa.distributed import (
    DistributedEngine,
    LocalCommunicator,
    MemoryEstimate,
    Placement,
    PreconditionedGradient,
    TorchDistCommunicator,
)
from kaisa.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from kaisa.hyperparams import Schedule
from kaisa.layers import Conv2dLayer, KFACLayer, LinearLayer

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
    ) -> None:
        self._args = args = parse_arguments(
            model,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            damping=damping,
            factor_decay=factor_decay,
            kl_clip=kl_clip,
            lr=lr,
            accumulation_steps=accumulation_steps,
            allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
            assignment_strategy=assignment_strategy,
            colocate_factors=colocate_factors,
            compute_method=compute_method,
            compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
            grad_worker_fraction=grad_worker_fraction,
            memory_budget_mb=memory_budget_mb,
            symmetry_aware=symmetry_aware,
            grad_scaler=grad_scaler,
            factor_dtype=factor_dtype,
            inv_dtype=inv_dtype,
            skip_layers=skip_layers,
            update_factors_in_hook=update_factors_in_hook,
            loglevel=loglevel,
        )
        self._model = model
        # The hyperparameter schedules (checkpoints restore the non-callable ones).
        self._schedules: dict[str, Any] = {name: getattr(args, name) for name in HYPERPARAMETERS}
        self._steps = 0
        self._timings = dict.fromkeys(TIMING_KEYS, 0.0)
        self._warned_silent: set[str] = set()

        self._layers = _register_layers(model, args.skip_patterns, args.factor_dtype)
        if not self._layers:
            raise ValueError(
                "model has no supported layer to precondition (nn.Linear, nn.Conv2d with "
                "trainable weights, not matched by skip_layers)"
            )
        self._engine = DistributedEngine(self._layers, args, self._timed)
        self._distributed = self._engine.distributed
        self._handles = [
            layer.module.register_forward_hook(self._make_forward_hook(layer))
            for layer in self._layers.values()
        ]
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

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimisation step."""
        return self._args.accumulation_steps

    @property
    def compute_method(self) -> ComputeMethod:
        """Eigen or inverse."""
        return self._args.compute_method

    @property
    def assignment_strategy(self) -> AssignmentStrategy:
        """Cost model for placing decompositions."""
        return self._args.assignment_strategy

    @property
    def grad_worker_fraction(self) -> float:
        """Fraction of ranks that are gradient workers for each layer (1 at world size 1)."""
        return float(self._engine.grid.fraction)

    @property
    def distributed_strategy(self) -> DistributedStrategy | float | str:
        """The ``grad_worker_fraction`` argument as parsed (``'auto'`` stays ``'auto'``)."""
        return self._args.grad_worker_fraction

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
    def communicator(self) -> LocalCommunicator | TorchDistCommunicator:
        """The communicator (its ``stats`` count bytes sent and time waited)."""
        return self._engine.communicator

    @property
    def factor_dtype(self) -> torch.dtype | None:
        """Factor dtype (``None``: the activations', at least float32)."""
        return self._args.factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype:
        """Storage dtype of decompositions."""
        return self._args.inv_dtype

    @property
    def layers(self) -> dict[str, KFACLayer]:
        """Registered layers by module name."""
        return dict(self._layers)

    @property
    def timings(self) -> dict[str, float]:
        """Cumulative host seconds by phase (on CUDA, launch time unless synchronised)."""
        return dict(self._timings)

    def reset_timings(self) -> None:
        """Zero :attr:`timings`."""
        self._timings = dict.fromkeys(TIMING_KEYS, 0.0)

    @property
    def skipped_factor_updates(self) -> int:
        """Per-batch factors not folded in because they were non-finite (syncs once)."""
        counts = [
            t for la in self._layers.values() for t in (la.skipped_a, la.skipped_g) if t is not None
        ]
        if not counts:
            return 0
        total = torch.stack([c.to("cpu", non_blocking=False) for c in counts]).sum()
        return int(total.item())

    # ------------------------------------------------------------------ hooks
    def _recording(self, module: nn.Module) -> bool:
        return (
            module.training
            and torch.is_grad_enabled()
            and self._steps % self.factor_update_steps == 0
        )

    def _make_forward_hook(
        self, layer: KFACLayer
    ) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._recording(module) or not isinstance(output, torch.Tensor):
                return
            if not output.requires_grad or not args or not isinstance(args[0], torch.Tensor):
                return  # e.g. a keyword-only call: nothing to record, never raise
            layer.hooks_fired = True
            if self._distributed:
                self._engine.record_forward(layer)
            x = args[0].detach()
            with self._timed("factors"), _no_autocast(x):
                if self._args.update_factors_in_hook:
                    layer.accumulate_a(layer.compute_a_batch(x))
                else:
                    layer.saved_inputs.append(x)
            output.register_hook(self._make_grad_hook(layer))  # type: ignore[no-untyped-call]

        return hook

    def _make_grad_hook(self, layer: KFACLayer) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            d = grad.detach()
            with self._timed("factors"), _no_autocast(d):
                if self._args.update_factors_in_hook:
                    scale = loss_scale(self._args.grad_scaler)
                    layer.accumulate_g(layer.compute_g_batch(d, scale))
                else:
                    layer.saved_grads.append(d)
            if self._distributed and self._args.update_factors_in_hook:
                self._engine.record_backward(layer)

        return hook

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
                self._update_decompositions(self.damping)
        with self._timed("preconditioning"):
            self._precondition_and_write(self.damping, self.kl_clip, self.lr)
        self._steps += 1
        if self._distributed:
            self._engine.end_step()

    def _update_factors(self, rho: float) -> None:
        recorded = False
        scale = loss_scale(self._args.grad_scaler) if not self._args.update_factors_in_hook else 1.0
        first_weight = next(iter(self._layers.values())).weight
        for layer in self._layers.values():
            if layer.saved_inputs or layer.saved_grads:
                with _no_autocast(first_weight):
                    for x in layer.saved_inputs:
                        layer.accumulate_a(layer.compute_a_batch(x))
                    for d in layer.saved_grads:
                        layer.accumulate_g(layer.compute_g_batch(d, scale))
                layer.saved_inputs.clear()
                layer.saved_grads.clear()
            if self._distributed:
                self._engine.start_factor_allreduce(layer)
            else:
                recorded = _fold(layer, layer.take_batch_factors(), rho) or recorded
        if self._distributed:
            # Average over ranks BEFORE folding: every rank folds the same batch factor.
            averaged = self._engine.averaged_factors()
            for name, layer in self._layers.items():
                recorded = _fold(layer, averaged.get(name, (None, None)), rho) or recorded
        if recorded:
            for name, layer in self._layers.items():
                if layer.a is None and layer.g is None and name not in self._warned_silent:
                    self._warned_silent.add(name)
                    msg = (
                        f"kaisa: the hooks of registered layer {name!r} "
                        f"({type(layer.module).__name__}) did not fire (is it called "
                        "functionally, like nn.MultiheadAttention.out_proj?); it is left "
                        "unpreconditioned until they do"
                    )
                    warnings.warn(msg, RuntimeWarning, stacklevel=3)
                    logger.warning(msg)

    def _update_decompositions(self, damping: float) -> None:
        if self._distributed:
            self._engine.update_decompositions(damping)
            return
        layers = [la for la in self._layers.values() if la.a is not None and la.g is not None]
        if not layers:
            return
        names = [f"{la.name}.A" for la in layers] + [f"{la.name}.G" for la in layers]
        mats = [la.a for la in layers] + [la.g for la in layers]
        n, inv_dtype = len(layers), self._args.inv_dtype
        if self._args.compute_method is ComputeMethod.EIGEN:
            res = linalg.eigen_decompositions(mats, inv_dtype=inv_dtype, names=names)
            outer = damping if self._args.compute_eigenvalue_outer_product else None
            for i, layer in enumerate(layers):
                layer.set_eigen(res[i], res[n + i], damping=outer)
        else:
            inv = linalg.damped_inverses(mats, damping=damping, inv_dtype=inv_dtype, names=names)
            for i, layer in enumerate(layers):
                layer.set_inverses(inv[i], inv[n + i])

    def _precondition_and_write(self, damping: float, kl_clip: float | None, lr: float) -> None:
        pairs: list[PreconditionedGradient] = []
        if self._distributed and self._engine.broadcasts_gradients:
            pairs = self._engine.preconditioned_gradients(damping)
        else:
            for layer in self._layers.values():
                if not layer.has_decomposition():
                    continue
                grad = layer.grad_matrix()
                if grad is None:
                    continue
                precond = layer.precondition(grad, damping)
                if precond is not None:
                    pairs.append((layer, grad, precond, None))
        if not pairs:
            return
        # Per-layer finiteness as device tensors (no host sync): a layer whose preconditioned
        # gradient is non-finite keeps its original gradient and is left out of the KL sum.
        # A non-finite element of P makes sum(P * grad) (or sum(P)) non-finite, so one
        # reduction per layer decides.
        checks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, g, p, valid in pairs:
            acc = torch.promote_types(p.dtype, torch.float32)
            t = (p.to(acc) * g.to(acc)).sum() if kl_clip is not None else p.sum(dtype=acc)
            ok = torch.isfinite(t)
            checks.append((t, ok if valid is None else ok & valid))
        nu: torch.Tensor | None = None
        if kl_clip is not None:
            device = checks[0][0].device
            terms = [torch.where(ok, t, torch.zeros_like(t)).to(device) for t, ok in checks]
            vg = torch.stack(terms).to(torch.float64).sum() * (lr * lr)
            ratio = torch.sqrt(kl_clip / vg.abs())
            nu = torch.where(vg == 0, torch.ones_like(vg), ratio.clamp(max=1.0))
        for (layer, g, p, _), (_, ok) in zip(pairs, checks, strict=True):
            scaled = p if nu is None else p * nu.to(p.device, p.dtype)
            layer.write_grad(torch.where(ok, scaled, g))

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
                layer.clear_decompositions()
        need = any(
            la.a is not None and not la.has_decomposition() and self._engine.is_grad_worker(name)
            for name, la in self._layers.items()
        )
        if self._distributed:
            need = self._engine.any_rank(need)  # every rank takes part in the broadcasts
        if compute_inverses and need:
            self._update_decompositions(self.damping)

    def memory_estimates(self) -> dict[Fraction, MemoryEstimate]:
        """Modelled per-rank K-FAC memory for every valid ``grad_worker_fraction``.

        This is the model ``grad_worker_fraction='auto'`` uses: an upper bound of what
        :meth:`memory_usage` reports, since it includes the per-step buffers (batch
        factors awaiting their allreduce, received preconditioned gradients).

        Returns:
            ``fraction -> estimate``, largest fraction (least communication) first.
        """
        return self._engine.memory_estimates()

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

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model's modules."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __repr__(self) -> str:
        def show(value: object) -> str:
            return "<callable>" if callable(value) else repr(value)

        args, fraction = self._args, self._args.grad_worker_fraction
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


def _register_layers(
    model: nn.Module, skip: tuple[re.Pattern[str], ...], factor_dtype: torch.dtype | None
) -> dict[str, KFACLayer]:
    layers: dict[str, KFACLayer] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        cls_name = type(module).__name__
        if any(r.search(name) or r.search(cls_name) for r in skip):
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if not all(p.requires_grad for p in params):
            continue
        if isinstance(module, nn.Conv2d):
            if module.padding_mode != "zeros":
                warnings.warn(
                    f"kaisa: not registering {name!r}: padding_mode={module.padding_mode!r} "
                    "is not supported (only 'zeros')",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            layers[name] = Conv2dLayer(name=name, module=module, factor_dtype=factor_dtype)
        else:
            layers[name] = LinearLayer(name=name, module=module, factor_dtype=factor_dtype)
    return layers


def _fold(
    layer: KFACLayer, batches: tuple[torch.Tensor | None, torch.Tensor | None], rho: float
) -> bool:
    """Folds batch factors into ``layer``'s running factors; whether there were any."""
    a_batch, g_batch = batches
    layer.fold(a_batch, g_batch, rho)
    return a_batch is not None or g_batch is not None


@contextmanager
def _no_autocast(t: torch.Tensor) -> Iterator[None]:
    """No autograd and, when autocast is on, full precision for factor computations."""
    if torch.is_autocast_enabled(t.device.type):
        with torch.no_grad(), torch.autocast(device_type=t.device.type, enabled=False):
            yield
    else:
        with torch.no_grad():
            yield
