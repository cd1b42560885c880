"""The K-FAC preconditioner: registers layers, records statistics, preconditions grads.

Math lives in :mod:`kaisa.factors` and :mod:`kaisa.linalg`, kernels in :mod:`kaisa.ops`,
per-layer state in :mod:`kaisa.layers`; this module orchestrates them step by step.
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
import torch.distributed as dist
from torch import nn

from kaisa import linalg
from kaisa.distributed import (
    CommHandle,
    LocalCommunicator,
    MemoryEstimate,
    Placement,
    TorchDistCommunicator,
    WorkerGrid,
    choose_fraction,
    estimate_memory,
    make_communicator,
    place_layers,
    resolve_grad_workers,
    valid_fractions,
)
from kaisa.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, parse_enum
from kaisa.hyperparams import Schedule, check_float, check_int, evaluate
from kaisa.layers import Conv2dLayer, KFACLayer, LinearLayer
from kaisa.linalg import EigenResult

__all__ = ["KFACPreconditioner"]

logger = logging.getLogger("kaisa")

TIMING_KEYS = ("factors", "communication", "decompositions", "preconditioning")
_HYPERPARAMETERS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)


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
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_int("factor_update_steps", factor_update_steps)
        check_int("inv_update_steps", inv_update_steps)
        check_float("damping", damping, low=0.0)
        check_float("factor_decay", factor_decay, low=0.0, high=1.0)
        if kl_clip is not None:
            check_float("kl_clip", kl_clip, low=0.0)
        check_float("lr", lr, low=0.0)
        check_int("accumulation_steps", accumulation_steps)
        check_float("allreduce_bucket_cap_mb", allreduce_bucket_cap_mb, low=0.0, low_inclusive=True)
        if callable(allreduce_bucket_cap_mb):
            raise ValueError("allreduce_bucket_cap_mb must be a number")
        for flag, value in (
            ("colocate_factors", colocate_factors),
            ("compute_eigenvalue_outer_product", compute_eigenvalue_outer_product),
            ("symmetry_aware", symmetry_aware),
            ("update_factors_in_hook", update_factors_in_hook),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{flag} must be a bool, got {value!r}")
        self._compute_method = parse_enum(ComputeMethod, compute_method, "compute_method")
        self._assignment_strategy = parse_enum(
            AssignmentStrategy, assignment_strategy, "assignment_strategy"
        )
        self._grad_worker_fraction = _parse_fraction(grad_worker_fraction)
        if self._grad_worker_fraction == "auto":
            if memory_budget_mb is None:
                raise ValueError("grad_worker_fraction='auto' needs memory_budget_mb")
        elif memory_budget_mb is not None:
            raise ValueError("memory_budget_mb is only used with grad_worker_fraction='auto'")
        if memory_budget_mb is not None:
            check_float("memory_budget_mb", memory_budget_mb, low=0.0)
            if callable(memory_budget_mb):
                raise ValueError("memory_budget_mb must be a number")
        for name, dt in (("factor_dtype", factor_dtype), ("inv_dtype", inv_dtype)):
            if dt is None and name == "factor_dtype":
                continue
            if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
                raise ValueError(f"{name} must be a floating torch.dtype, got {dt!r}")
        if grad_scaler is not None and not (
            callable(grad_scaler) or hasattr(grad_scaler, "get_scale")
        ):
            raise ValueError(
                "grad_scaler must be a torch.amp.GradScaler, torch.cuda.amp.GradScaler or a "
                f"callable returning the loss scale, got {type(grad_scaler).__name__}"
            )
        if not isinstance(loglevel, int):
            raise ValueError(f"loglevel must be an int logging level, got {loglevel!r}")
        if skip_layers is None:
            patterns: list[str] = []
        elif isinstance(skip_layers, str):
            patterns = [skip_layers]
        elif isinstance(skip_layers, (list, tuple)) and all(
            isinstance(p, str) for p in skip_layers
        ):
            patterns = list(skip_layers)
        else:
            raise ValueError(f"skip_layers must be a str or a list of str, got {skip_layers!r}")
        try:
            regexes = [re.compile(p) for p in patterns]
        except re.error as err:
            raise ValueError(f"skip_layers has an invalid regular expression: {err}") from None

        self._model = model
        self._factor_update_steps = factor_update_steps
        self._inv_update_steps = inv_update_steps
        self._damping = damping
        self._factor_decay = factor_decay
        self._kl_clip = kl_clip
        self._lr = lr
        self._accumulation_steps = accumulation_steps
        self._allreduce_bucket_cap_mb = float(allreduce_bucket_cap_mb)
        self._colocate_factors = colocate_factors
        self._compute_eigenvalue_outer_product = compute_eigenvalue_outer_product
        self._symmetry_aware = symmetry_aware
        self._grad_scaler = grad_scaler
        self._factor_dtype = factor_dtype
        self._inv_dtype = inv_dtype
        self._skip_layers = patterns
        self._update_factors_in_hook = update_factors_in_hook
        self._loglevel = loglevel
        self._steps = 0
        self._timings = dict.fromkeys(TIMING_KEYS, 0.0)
        self._warned_silent: set[str] = set()

        self._layers = _register_layers(model, regexes, factor_dtype)
        if not self._layers:
            raise ValueError(
                "model has no supported layer to precondition (nn.Linear, nn.Conv2d with "
                "trainable weights, not matched by skip_layers)"
            )
        self._setup_distribution(memory_budget_mb)
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
        value = evaluate("factor_update_steps", self._factor_update_steps, self._steps, int)
        check_int("factor_update_steps", value)
        return value

    @property
    def inv_update_steps(self) -> int:
        """Steps between decomposition updates, at the current step."""
        value = evaluate("inv_update_steps", self._inv_update_steps, self._steps, int)
        check_int("inv_update_steps", value)
        return value

    @property
    def damping(self) -> float:
        """Damping at the current step."""
        value = evaluate("damping", self._damping, self._steps, float)
        check_float("damping", value, low=0.0)
        return value

    @property
    def factor_decay(self) -> float:
        """Running-average decay ``rho`` at the current step."""
        value = evaluate("factor_decay", self._factor_decay, self._steps, float)
        check_float("factor_decay", value, low=0.0, high=1.0)
        return value

    @property
    def kl_clip(self) -> float | None:
        """KL-clip threshold at the current step (``None`` disables clipping)."""
        if self._kl_clip is None:
            return None
        value = evaluate("kl_clip", self._kl_clip, self._steps, float)
        check_float("kl_clip", value, low=0.0)
        return value

    @property
    def lr(self) -> float:
        """Learning rate used by KL clipping, at the current step."""
        value = evaluate("lr", self._lr, self._steps, float)
        check_float("lr", value, low=0.0)
        return value

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimisation step."""
        return self._accumulation_steps

    @property
    def compute_method(self) -> ComputeMethod:
        """Eigen or inverse."""
        return self._compute_method

    @property
    def assignment_strategy(self) -> AssignmentStrategy:
        """Cost model for placing decompositions."""
        return self._assignment_strategy

    @property
    def grad_worker_fraction(self) -> float:
        """Fraction of ranks that are gradient workers for each layer (1 at world size 1)."""
        return float(self._grid.fraction)

    @property
    def distributed_strategy(self) -> DistributedStrategy | float | str:
        """The ``grad_worker_fraction`` argument as parsed (``'auto'`` stays ``'auto'``)."""
        return self._grad_worker_fraction

    @property
    def placement(self) -> Placement:
        """Which rank computes and broadcasts each layer's decompositions and gradient."""
        return self._placement

    @property
    def rank(self) -> int:
        """This process's rank (0 without torch.distributed)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks sharing the K-FAC work (1 without torch.distributed)."""
        return self._world

    @property
    def communicator(self) -> LocalCommunicator | TorchDistCommunicator:
        """The communicator (its ``stats`` count bytes sent and time waited)."""
        return self._comm

    @property
    def factor_dtype(self) -> torch.dtype | None:
        """Factor dtype (``None``: the activations', at least float32)."""
        return self._factor_dtype

    @property
    def inv_dtype(self) -> torch.dtype:
        """Storage dtype of decompositions."""
        return self._inv_dtype

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
            if not output.requires_grad:
                return
            layer.hooks_fired = True
            self._forward_calls[layer.name] = self._forward_calls.get(layer.name, 0) + 1
            x = args[0].detach()
            with self._timed("factors"), _no_autocast(x):
                if self._update_factors_in_hook:
                    layer.accumulate_a(layer.compute_a_batch(x))
                else:
                    layer.saved_inputs.append(x)
            output.register_hook(self._make_grad_hook(layer))  # type: ignore[no-untyped-call]

        return hook

    def _make_grad_hook(self, layer: KFACLayer) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            d = grad.detach()
            with self._timed("factors"), _no_autocast(d):
                if self._update_factors_in_hook:
                    layer.accumulate_g(layer.compute_g_batch(d, self._loss_scale()))
                else:
                    layer.saved_grads.append(d)
            if self._distributed and self._update_factors_in_hook:
                self._after_grad_hook(layer)

        return hook

    # ------------------------------------------------------------------ distribution
    def _setup_distribution(self, memory_budget_mb: float | None) -> None:
        """Chooses the grid, the placement and the communicator (see class docstring)."""
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        else:
            self._rank, self._world = 0, 1
        self._distributed = self._world > 1
        dims = {name: _layer_dims(layer) for name, layer in self._layers.items()}
        factor_dtype = self._factor_dtype or _first_param_dtype(self)
        self._memory_model: dict[str, Any] = {
            "compute_method": self._compute_method.value,
            "itemsize": torch.empty((), dtype=factor_dtype).element_size(),
            "inv_itemsize": torch.empty((), dtype=self._inv_dtype).element_size(),
            "outer_product": self._compute_eigenvalue_outer_product,
            "layer_groups": {name: layer.groups for name, layer in self._layers.items()},
            "assignment_strategy": self._assignment_strategy.value,
            "colocate_factors": self._colocate_factors,
        }
        self._layer_dims = dims
        if self._grad_worker_fraction == "auto":
            assert memory_budget_mb is not None
            estimate = choose_fraction(
                dims, self._world, float(memory_budget_mb), **self._memory_model
            )
            grad_workers = int(estimate.fraction * self._world)
            logger.log(
                self._loglevel,
                "kaisa: grad_worker_fraction='auto' chose %s (modelled peak %.3f MB <= %s MB)",
                estimate.fraction,
                estimate.max_total_mb,
                memory_budget_mb,
            )
        else:
            try:
                grad_workers = resolve_grad_workers(self._grad_worker_fraction, self._world)
            except (TypeError, ValueError) as err:
                raise ValueError(str(err)) from None
        self._grid = WorkerGrid(self._world, grad_workers)
        self._placement = place_layers(
            dims, self._grid, self._assignment_strategy.value, self._colocate_factors
        )
        self._comm: LocalCommunicator | TorchDistCommunicator = make_communicator(
            self._grid.worker_groups() + self._grid.receiver_groups(),
            bucket_cap_mb=self._allreduce_bucket_cap_mb,
        )
        self._receiver_group = {
            w: self._grid.receiver_groups()[self._grid.receiver_group_of(w)]
            for w in range(self._world)
        }
        # Per-step bookkeeping of the asynchronous factor allreduce.
        self._forward_calls: dict[str, int] = {}
        self._grad_calls: dict[str, int] = {}
        self._micro_batches = 0
        self._callback_queued = False
        self._pending_factors: dict[str, tuple[CommHandle | None, CommHandle | None]] = {}
        if self._distributed and self._rank == 0:
            logger.log(self._loglevel, "%s", self._placement.describe())

    def _after_grad_hook(self, layer: KFACLayer) -> None:
        """Launches a layer's factor allreduce once its last G of the step is ready."""
        name = layer.name
        self._grad_calls[name] = self._grad_calls.get(name, 0) + 1
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if (
            self._micro_batches == self._accumulation_steps - 1
            and self._grad_calls[name] == self._forward_calls.get(name, 0)
            and name not in self._pending_factors
        ):
            self._launch_factor_allreduce(layer)

    def _on_backward_end(self) -> None:
        """End of a backward pass: after the last micro-batch, flush every bucket."""
        self._callback_queued = False
        self._micro_batches += 1
        if self._micro_batches >= self._accumulation_steps:
            for layer in self._layers.values():
                if layer.name not in self._pending_factors and (
                    layer.a_sum is not None or layer.g_sum is not None
                ):
                    self._launch_factor_allreduce(layer)
            self._comm.flush()

    def _launch_factor_allreduce(self, layer: KFACLayer) -> None:
        """Starts the averaging of a layer's batch factors over ranks."""
        a_batch, g_batch = layer.take_batch_factors()
        sym = self._symmetry_aware
        self._pending_factors[layer.name] = (
            None if a_batch is None else self._comm.allreduce_mean(a_batch, symmetric=sym),
            None if g_batch is None else self._comm.allreduce_mean(g_batch, symmetric=sym),
        )

    def _loss_scale(self) -> float | torch.Tensor:
        scaler = self._grad_scaler
        if scaler is None:
            return 1.0
        if hasattr(scaler, "get_scale"):
            if hasattr(scaler, "is_enabled") and not scaler.is_enabled():
                return 1.0
            get_async = getattr(scaler, "_get_scale_async", None)
            scale = get_async() if get_async is not None else None
            if isinstance(scale, torch.Tensor):
                return scale.detach()
            return float(scaler.get_scale())
        value = scaler()
        return value.detach() if isinstance(value, torch.Tensor) else float(value)

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
        self._forward_calls.clear()
        self._grad_calls.clear()
        self._micro_batches = 0

    def _update_factors(self, rho: float) -> None:
        recorded = False
        scale = self._loss_scale() if not self._update_factors_in_hook else 1.0
        for layer in self._layers.values():
            if layer.saved_inputs or layer.saved_grads:
                with _no_autocast(self._model_param()):
                    for x in layer.saved_inputs:
                        layer.accumulate_a(layer.compute_a_batch(x))
                    for d in layer.saved_grads:
                        layer.accumulate_g(layer.compute_g_batch(d, scale))
                layer.saved_inputs.clear()
                layer.saved_grads.clear()
            if not self._distributed:
                a_batch, g_batch = layer.take_batch_factors()
                recorded = recorded or a_batch is not None or g_batch is not None
                layer.fold(a_batch, g_batch, rho)
            elif layer.name not in self._pending_factors and (
                layer.a_sum is not None or layer.g_sum is not None
            ):
                self._launch_factor_allreduce(layer)
        if self._distributed:
            # Average over ranks BEFORE folding: every rank folds the same batch factor,
            # so the running factors (and the non-finite skips) stay identical.
            self._comm.flush()
            with self._timed("communication"):
                averaged = {
                    name: (
                        None if ha is None else ha.wait(),
                        None if hg is None else hg.wait(),
                    )
                    for name, (ha, hg) in self._pending_factors.items()
                }
            self._pending_factors.clear()
            for name, layer in self._layers.items():
                a_batch, g_batch = averaged.get(name, (None, None))
                recorded = recorded or a_batch is not None or g_batch is not None
                layer.fold(a_batch, g_batch, rho)
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
            self._update_decompositions_distributed(damping)
            return
        layers = [la for la in self._layers.values() if la.a is not None and la.g is not None]
        if not layers:
            return
        names = [f"{la.name}.A" for la in layers] + [f"{la.name}.G" for la in layers]
        mats = [la.a for la in layers] + [la.g for la in layers]
        n = len(layers)
        if self._compute_method is ComputeMethod.EIGEN:
            res = linalg.eigen_decompositions(mats, inv_dtype=self._inv_dtype, names=names)
            outer = damping if self._compute_eigenvalue_outer_product else None
            for i, layer in enumerate(layers):
                layer.set_eigen(res[i], res[n + i], damping=outer)
        else:
            inv = linalg.damped_inverses(
                mats, damping=damping, inv_dtype=self._inv_dtype, names=names
            )
            for i, layer in enumerate(layers):
                layer.set_inverses(inv[i], inv[n + i])

    def _update_decompositions_distributed(self, damping: float) -> None:
        """Decomposes this rank's assigned factors and broadcasts them to grad workers.

        A failed decomposition keeps the previous one on every gradient worker: the
        source sends its previous result (or NaNs when there is none, which receivers
        treat as "no decomposition").
        """
        layers = [la for la in self._layers.values() if la.a is not None and la.g is not None]
        if not layers:
            return
        rank = self._rank
        eigen = self._compute_method is ComputeMethod.EIGEN
        mine: list[tuple[KFACLayer, str]] = []
        for la in layers:
            lp = self._placement[la.name]
            if lp.a_rank == rank:
                mine.append((la, "A"))
            if lp.g_rank == rank:
                mine.append((la, "G"))
        mats = [la.a if which == "A" else la.g for la, which in mine]
        names = [f"{la.name}.{which}" for la, which in mine]
        computed: dict[tuple[str, str], EigenResult | torch.Tensor | None] = {}
        if mine:
            results: list[Any]
            if eigen:
                results = linalg.eigen_decompositions(mats, inv_dtype=self._inv_dtype, names=names)
            else:
                results = linalg.damped_inverses(
                    mats, damping=damping, inv_dtype=self._inv_dtype, names=names
                )
            for (la, which), res in zip(mine, results, strict=True):
                computed[(la.name, which)] = res
        sym = self._symmetry_aware
        pending: list[tuple[KFACLayer, str, int, list[torch.Tensor], list[CommHandle]]] = []
        for la in layers:
            lp = self._placement[la.name]
            if rank not in lp.grad_workers:
                continue
            for which, src in (("A", lp.a_rank), ("G", lp.g_rank)):
                factor = la.a if which == "A" else la.g
                assert factor is not None
                tensors = self._decomposition_payload(la, which, factor, src, computed)
                handles = []
                for i, t in enumerate(tensors):
                    symmetric = sym and not eigen and i == 0
                    handles.append(
                        self._comm.broadcast(t, src, lp.grad_workers, symmetric=symmetric)
                    )
                pending.append((la, which, src, tensors, handles))
        self._comm.flush()
        received: dict[tuple[str, str], EigenResult | torch.Tensor | None] = {}
        with self._timed("communication"):
            for la, which, src, _, handles in pending:
                got = [h.wait() for h in handles]
                if src == rank:
                    received[(la.name, which)] = computed[(la.name, which)]
                elif not bool(torch.isfinite(got[0]).all()):
                    received[(la.name, which)] = None
                elif eigen:
                    received[(la.name, which)] = EigenResult(
                        eigenvalues=got[1], eigenvectors=got[0]
                    )
                else:
                    received[(la.name, which)] = got[0]
        outer = damping if self._compute_eigenvalue_outer_product else None
        for la in layers:
            if (la.name, "A") not in received:
                continue
            a_res, g_res = received[(la.name, "A")], received[(la.name, "G")]
            if eigen:
                assert not isinstance(a_res, torch.Tensor)
                assert not isinstance(g_res, torch.Tensor)
                la.set_eigen(a_res, g_res, damping=outer)
            else:
                assert not isinstance(a_res, EigenResult)
                assert not isinstance(g_res, EigenResult)
                la.set_inverses(a_res, g_res)

    def _decomposition_payload(
        self,
        layer: KFACLayer,
        which: str,
        factor: torch.Tensor,
        src: int,
        computed: dict[tuple[str, str], EigenResult | torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Tensors broadcast for one factor: the data on ``src``, buffers elsewhere."""
        eigen = self._compute_method is ComputeMethod.EIGEN
        blocks, n = factor.shape[0], factor.shape[-1]
        dtype, device = self._inv_dtype, factor.device
        if src != self._rank:
            if eigen:
                return [
                    torch.empty((blocks, n, n), dtype=dtype, device=device),
                    torch.empty((blocks, n), dtype=dtype, device=device),
                ]
            return [torch.empty((blocks, n, n), dtype=dtype, device=device)]
        res = computed[(layer.name, which)]
        if eigen:
            if isinstance(res, EigenResult):
                return [res.eigenvectors, res.eigenvalues]
            q, d = (layer.qa, layer.da) if which == "A" else (layer.qg, layer.dg)
            if q is not None and d is not None:
                return [q, d]
            nan = float("nan")
            return [
                torch.full((blocks, n, n), nan, dtype=dtype, device=device),
                torch.full((blocks, n), nan, dtype=dtype, device=device),
            ]
        if isinstance(res, torch.Tensor):
            return [res]
        prev = layer.a_inv if which == "A" else layer.g_inv
        if prev is not None:
            return [prev]
        return [torch.full((blocks, n, n), float("nan"), dtype=dtype, device=device)]

    def _distributed_preconditioned(
        self, damping: float
    ) -> list[tuple[KFACLayer, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Preconditioned gradients on every rank when some ranks are not grad workers.

        Grad workers precondition and broadcast ``[P.flatten(), valid]`` to the other
        ranks of their receiver group; every rank then holds every layer's result.
        """
        rank = self._rank
        entries: list[
            tuple[KFACLayer, torch.Tensor, torch.Tensor | None, torch.Tensor, CommHandle | None]
        ] = []
        for layer in self._layers.values():
            grad = layer.grad_matrix()
            if grad is None:
                continue
            lp = self._placement[layer.name]
            if rank in lp.grad_workers:
                precond = layer.precondition(grad, damping) if layer.has_decomposition() else None
                buf = grad.new_zeros(grad.numel() + 1)
                if precond is not None:
                    buf[:-1].copy_(precond.reshape(-1))
                    buf[-1] = 1.0
                handle = None
                if lp.grad_receivers[rank]:
                    handle = self._comm.broadcast(
                        buf, rank, self._receiver_group[rank], kind="gradients"
                    )
                entries.append((layer, grad, precond, buf, handle))
            else:
                src = lp.grad_source(rank)
                buf = grad.new_empty(grad.numel() + 1)
                handle = self._comm.broadcast(buf, src, self._receiver_group[src], kind="gradients")
                entries.append((layer, grad, None, buf, handle))
        self._comm.flush()
        out: list[tuple[KFACLayer, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        with self._timed("communication"):
            for layer, grad, _, buf, handle in entries:
                if handle is not None:
                    handle.wait()
                out.append((layer, grad, buf[:-1].view_as(grad), buf[-1] > 0))
        return out

    def _precondition_and_write(self, damping: float, kl_clip: float | None, lr: float) -> None:
        pairs: list[tuple[KFACLayer, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if self._distributed and self._grid.grad_workers < self._world:
            pairs = self._distributed_preconditioned(damping)
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
        # Per-layer finiteness as device tensors: a layer whose preconditioned gradient is
        # non-finite keeps its original gradient and is left out of the KL sum.
        finite = [
            torch.isfinite(p).all() if valid is None else torch.isfinite(p).all() & valid
            for _, _, p, valid in pairs
        ]
        nu: torch.Tensor | None = None
        if kl_clip is not None:
            terms = []
            for (_, g, p, _), ok in zip(pairs, finite, strict=True):
                acc = torch.promote_types(p.dtype, torch.float32)
                t = (p.to(acc) * g.to(acc)).sum()
                terms.append(torch.where(ok & torch.isfinite(t), t, torch.zeros_like(t)))
            device = terms[0].device
            vg = torch.stack([t.to(device, torch.float64) for t in terms]).sum() * (lr * lr)
            ratio = torch.sqrt(kl_clip / vg.abs())
            nu = torch.where(vg == 0, torch.ones_like(vg), ratio.clamp(max=1.0))
        for (layer, g, p, _), ok in zip(pairs, finite, strict=True):
            scaled = p if nu is None else p * nu.to(p.device, p.dtype)
            layer.write_grad(torch.where(ok, scaled, g))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """Everything a step reads: steps, non-callable hyperparameters, factors, decompositions.

        Args:
            include_factors: include per-layer factors and decompositions.
        """
        state: dict[str, Any] = {"steps": self._steps}
        for name in _HYPERPARAMETERS:
            value = getattr(self, f"_{name}")
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
        for name in _HYPERPARAMETERS:
            if name in state_dict and not callable(getattr(self, f"_{name}")):
                setattr(self, f"_{name}", state_dict[name])
        if layers is None:
            return
        for name, layer in self._layers.items():
            layer.load_state_dict(layers[name])
            if not self._placement[name].is_grad_worker(self._rank):
                layer.clear_decompositions()
        need = any(
            la.a is not None
            and not la.has_decomposition()
            and self._placement[la.name].is_grad_worker(self._rank)
            for la in self._layers.values()
        )
        if self._distributed:
            # Every rank must take part in the decomposition broadcasts.
            flag = torch.tensor([1.0 if need else 0.0])
            need = bool(self._comm.allreduce_mean(flag, kind="control").wait()[0] > 0)
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
        return {
            f: estimate_memory(
                self._layer_dims,
                WorkerGrid(self._world, int(f * self._world)),
                **self._memory_model,
            )
            for f in valid_fractions(self._world)
        }

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

        fields = {
            "layers": len(self._layers),
            "steps": self._steps,
            "compute_method": self._compute_method.value,
            "factor_update_steps": show(self._factor_update_steps),
            "inv_update_steps": show(self._inv_update_steps),
            "damping": show(self._damping),
            "factor_decay": show(self._factor_decay),
            "kl_clip": show(self._kl_clip),
            "lr": show(self._lr),
            "accumulation_steps": self._accumulation_steps,
            "grad_worker_fraction": _show_fraction(self._grad_worker_fraction),
            "inv_dtype": self._inv_dtype,
            "factor_dtype": self._factor_dtype,
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

    def _model_param(self) -> torch.Tensor:
        weight = next(iter(self._layers.values())).module.weight
        assert isinstance(weight, torch.Tensor)
        return weight


def _register_layers(
    model: nn.Module, skip: list[re.Pattern[str]], factor_dtype: torch.dtype | None
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


def _layer_dims(layer: KFACLayer) -> tuple[int, int]:
    """``(a_dim, g_dim)`` of one Kronecker block of a registered layer."""
    module = layer.module
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    g_dim = weight.shape[0] // layer.groups
    a_dim = weight[0].numel() + (1 if layer.has_bias else 0)
    return a_dim, g_dim


def _first_param_dtype(pre: KFACPreconditioner) -> torch.dtype:
    """Factor dtype when ``factor_dtype`` is None: the weights', at least float32."""
    dtype = pre._model_param().dtype
    return torch.promote_types(dtype, torch.float32)


def _parse_fraction(
    value: DistributedStrategy | float | str,
) -> DistributedStrategy | float | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool):
        raise ValueError(
            f"grad_worker_fraction must be a DistributedStrategy or float, got {value!r}"
        )
    if isinstance(value, (int, float)):
        if not 0.0 < float(value) <= 1.0:
            raise ValueError(f"grad_worker_fraction must be in (0, 1], got {value!r}")
        return float(value)
    return parse_enum(DistributedStrategy, value, "grad_worker_fraction")


def _show_fraction(value: DistributedStrategy | float | str) -> str:
    return value.name if isinstance(value, DistributedStrategy) else repr(value)


@contextmanager
def _no_autocast(t: torch.Tensor) -> Iterator[None]:
    with torch.no_grad(), torch.autocast(device_type=t.device.type, enabled=False):
        yield
