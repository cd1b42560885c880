"""Recording K-FAC statistics: module hooks, micro-batch counting, end of backward.

:class:`StatisticsRecorder` observes every registered block at its call sites
(:mod:`kaisa.blocks.callsites`, :meth:`~kaisa.blocks.CurvatureBlock.call_sites`): by default the
block's own module, through one forward hook; a block may also be observed through
several modules (one forward hook each), or through the ``F.linear`` calls made inside a
module's forward (one :class:`~kaisa.blocks.callsites.FunctionalTap` per such module, active
only while recording). Every observation, whatever its site, takes one path
(``_observe``): while recording (training mode, gradients on,
:attr:`StatisticsRecorder.recording` set by the curvature core for a factor-update step)
the block records the input (a batch A factor, or the input kept when factors are
computed in ``step()``), told the index of the site it came from, and the output's
gradient is hooked, which turns into a batch G factor. It counts observations and output
gradients per block and micro-batches per step, and tells its listener

* ``on_layer_done(layer)`` as soon as a layer's last output gradient of the step's last
  micro-batch has been recorded (the engine starts that layer's factor allreduce while
  the rest of the backward pass runs), and
* ``on_backward_end()`` at the end of the last micro-batch's backward pass.

Under ``torch.compile`` the hooks make no timing calls (``time.perf_counter`` would break
the graph); timings then cover only eager execution. Dynamo traces the output-gradient
hook when it is registered, and its updates of Python state cost graph breaks around
each registered layer (torch 2.13: 3 for a conv + linear model); results equal eager
execution (tests/core/test_compile.py).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils.hooks import RemovableHandle

from kaisa.blocks import CurvatureBlock
from kaisa.blocks.callsites import CallSite, Cut, FunctionalTap, hook_outputs
from kaisa.utils.profiling import timed

__all__ = ["StatisticsRecorder", "compute_saved", "full_precision", "loss_scale"]

logger = logging.getLogger("kaisa")


def loss_scale(grad_scaler: Any) -> float | torch.Tensor:
    """The current loss scale of a ``grad_scaler`` argument.

    Args:
        grad_scaler: ``None``, a GradScaler (its scale, 1 while disabled) or a callable
            returning the loss scale.

    Returns:
        The scale: a float, or a detached tensor when the scaler keeps it on a device.
    """
    if grad_scaler is None:
        return 1.0
    if hasattr(grad_scaler, "get_scale"):
        if hasattr(grad_scaler, "is_enabled") and not grad_scaler.is_enabled():
            return 1.0
        get_async = getattr(grad_scaler, "_get_scale_async", None)
        scale = get_async() if get_async is not None else None
        if isinstance(scale, torch.Tensor):
            return scale.detach()
        return float(grad_scaler.get_scale())
    value = grad_scaler()
    return value.detach() if isinstance(value, torch.Tensor) else float(value)


def full_precision(t: torch.Tensor) -> AbstractContextManager[Any]:
    """Autocast switched off for ``t``'s device while it is on (else a no-op context).

    A plain context object, not a generator, so ``torch.compile`` traces the hooks
    without a graph break. A device autocast does not know (``meta``) has none.
    """
    kind = t.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.autocast(device_type=kind, enabled=False)
    return nullcontext()


class StatisticsRecorder:
    """Hooks that record the statistics of the registered layers.

    Args:
        layers: The registered layers, in model order.
        in_hook: Compute batch factors in the hooks; else keep inputs and output
            gradients for :meth:`compute_saved`.
        grad_scaler: The ``grad_scaler`` argument: output gradients are divided by its
            loss scale unless :attr:`divisor` is set.
        accumulation_steps: Micro-batches per step.
        on_layer_done: Called with a layer whose statistics of the step are complete.
        on_backward_end: Called at the end of the last micro-batch's backward pass.
        timings: Seconds by phase; the hooks add to ``'factors'`` (eager mode only).
        on_statistics: Called with a layer whose statistics of the current micro-batch
            are complete (before ``on_layer_done`` for the last micro-batch).
        on_micro_batch_end: Called at the end of each micro-batch's backward pass (all
            its passes), before ``on_backward_end`` for the last one.
    """

    def __init__(
        self,
        layers: Mapping[str, CurvatureBlock],
        *,
        in_hook: bool,
        grad_scaler: Any,
        accumulation_steps: int,
        on_layer_done: Callable[[CurvatureBlock], None],
        on_backward_end: Callable[[], None],
        timings: MutableMapping[str, float],
        on_statistics: Callable[[CurvatureBlock], None] = lambda layer: None,
        on_micro_batch_end: Callable[[], None] = lambda: None,
    ) -> None:
        self._layers = layers
        self._in_hook = in_hook
        self._grad_scaler = grad_scaler
        self._accumulation_steps = accumulation_steps
        self._on_layer_done = on_layer_done
        self._on_backward_end = on_backward_end
        self._on_statistics = on_statistics
        self._on_micro_batch_end = on_micro_batch_end
        self._timings = timings
        #: Whether forward passes record statistics (a factor-update step).
        self.recording = False
        #: What sets :attr:`recording` for the coming step, called at its first observed
        #: forward pass (:meth:`resolve`); ``None`` once called.
        self.pending: Callable[[], None] | None = None
        #: Backward passes per recorded forward that record G (Monte-Carlo samples); 0
        #: for backward passes that must not contribute G (the true loss's, when G comes
        #: from sampled targets).
        self.g_passes = 1
        #: What output gradients are divided by; ``None``: the grad scaler's loss scale.
        self.divisor: float | torch.Tensor | None = None
        #: Whether recorded forward passes hook their outputs' gradients (``False``: only
        #: the inputs' A factors are recorded, one-sided; no hook runs in the backward pass).
        self.output_gradients = True
        #: Observe modules in evaluation mode too (influence's passes: statistics of the
        #: model as it predicts, without dropout); ``False``: training mode only.
        self.any_mode = False
        #: When set, every observed call's input and output gradient go to it, paired
        #: (``pairs(block, x, d, site)``, in the backward pass), instead of the block's
        #: statistics (influence's per-example gradients).
        self.pairs: Callable[[CurvatureBlock, torch.Tensor, torch.Tensor, int], None] | None = (
            None)
        #: Keep where the hooked outputs of recorded forward passes enter the graph, in
        #: :attr:`kept_outputs` (until :meth:`end_step`; edges, not the tensors): G's
        #: backward passes need only their gradients (:func:`kaisa.kfac.fisher.record_g`).
        self.keep_outputs = False
        self.kept_outputs: list[GradientEdge] = []
        self._forward_calls: dict[str, int] = {}
        self._grad_calls: dict[str, int] = {}
        # The same counts in the current micro-batch (the last backward pass's end resets).
        self._batch_forward: dict[str, int] = {}
        self._batch_grads: dict[str, int] = {}
        self._micro_batches = 0
        self._passes_done = 0
        self._callback_queued = False
        self._warned: set[str] = set()
        self._handles = []
        functional: dict[nn.Module, list[tuple[tuple[CurvatureBlock, int], CallSite]]] = {}
        for layer in layers.values():
            for index, site in enumerate(layer.call_sites()):
                if site.weight is None:
                    self._handles.append(
                        site.module.register_forward_hook(self._forward_hook(layer, index)))
                else:
                    functional.setdefault(site.module, []).append(((layer, index), site))
        self._taps: dict[nn.Module, tuple[FunctionalTap[tuple[CurvatureBlock, int]],
                                          list[RemovableHandle]]] = {}
        for module, sites in functional.items():
            self._tap(module, sites)

    def _tap(self, module: nn.Module,
             sites: list[tuple[tuple[CurvatureBlock, int], CallSite]]) -> None:
        tap = FunctionalTap(module, sites, active=self._active, observe=self._observe_call,
                            mismatch=self._mismatch)
        self._taps[module] = (tap, tap.install())

    def retap(self, module: nn.Module, layers: Mapping[str, CurvatureBlock]) -> None:
        """Observes ``module``'s functional sites for ``layers`` (its blocks were rebuilt).

        Called from a forward pre-hook of ``module`` that runs before the tap's: the old
        tap's pending pre-hook becomes a no-op and the new tap enters the call now.
        """
        self._layers = layers
        old, handles = self._taps.pop(module)
        old.retire()
        for handle in handles:
            handle.remove()
        self._tap(module, [((layer, index), site) for layer in layers.values()
                           for index, site in enumerate(layer.call_sites())
                           if site.weight is not None and site.module is module])
        self._taps[module][0].enter()

    def remove(self) -> None:
        """Detaches every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _, handles in self._taps.values():
            for handle in handles:
                handle.remove()
        self._taps.clear()

    def end_step(self) -> None:
        """Resets the per-step counters."""
        self._forward_calls.clear()
        self._grad_calls.clear()
        self._batch_forward.clear()
        self._batch_grads.clear()
        self._micro_batches = 0
        self._passes_done = 0
        self.kept_outputs.clear()

    def compute_saved(self) -> None:
        """Turns kept inputs / output gradients into batch factors (``in_hook=False``)."""
        for layer in self._layers.values():
            compute_saved(layer)

    # ------------------------------------------------------------------ hooks
    def _active(self, module: nn.Module) -> bool:
        """Whether a call of ``module`` is observed now (the one rule for every site).

        Never inside a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...): its
        tensors are wrapped for the transform's levels, and statistics of a
        per-sample or functional evaluation are not the training step's.
        """
        if not ((module.training or self.any_mode) and torch.is_grad_enabled()):
            return False  # an evaluation or no-grad forward reads no plan either
        if self.pending is not None:
            if not (torch.compiler.is_compiling() or not _in_functorch_transform()):
                return False  # nor does a transform's
            self.resolve()
        return self.recording and (torch.compiler.is_compiling()
                                   or not _in_functorch_transform())

    def resolve(self) -> None:
        """Calls :attr:`pending` (once it returns): the coming step's recording switch."""
        pending = self.pending
        if pending is not None:
            pending()
            self.pending = None

    def _forward_hook(
        self, layer: CurvatureBlock, site: int
    ) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self._active(module):
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if not args or not isinstance(args[0], torch.Tensor):
                return  # e.g. a keyword-only call: nothing to record, never raise
            self._observe(layer, site, self._plain(args[0]), (output,), None)

        return hook

    def _observe_call(
        self, key: tuple[CurvatureBlock, int], x: torch.Tensor,
        outputs: tuple[torch.Tensor, ...], cut: Cut,
    ) -> None:
        """One functional observation (:class:`~kaisa.blocks.callsites.FunctionalTap`)."""
        layer, site = key
        self._observe(layer, site, cut.input(self._plain(x)), outputs, cut)

    def _observe(
        self, layer: CurvatureBlock, site: int, x: torch.Tensor,
        outputs: tuple[torch.Tensor, ...], cut: Cut | None,
    ) -> None:
        """Records one use of ``layer`` at its call site ``site``; hooks the output gradient."""
        name = layer.name
        self._forward_calls[name] = self._forward_calls.get(name, 0) + 1
        self._batch_forward[name] = self._batch_forward.get(name, 0) + 1
        self._timed(self._record_input, layer, x, site)
        if not self.output_gradients:
            return
        hook_outputs(outputs, self._grad_hook(layer, x, site, cut))
        if self.keep_outputs:
            self.kept_outputs.extend(get_gradient_edge(t) for t in outputs if t.requires_grad)

    def _plain(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` without its autograd history where that matters: kept for ``step()``.

        Statistics computed in ``step()``, not in the hooks, keep their tensors until then.
        A tensor used at once under ``no_grad`` needs no ``detach`` (a call per factor).
        """
        return t.detach() if t.requires_grad and not self._in_hook else t

    def _mismatch(self, key: tuple[CurvatureBlock, int], site: CallSite) -> None:
        name = key[0].name
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(site.mismatch, RuntimeWarning, stacklevel=2)
            logger.warning("%s", site.mismatch)

    def _grad_hook(
        self, layer: CurvatureBlock, x: torch.Tensor, site: int, cut: Cut | None
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.g_passes == 0:
                return
            d = self._plain(grad) if cut is None else cut.grad(self._plain(grad))
            self._timed(self._record_grad, layer, d, x, site)
            if not self._in_hook:
                return
            name = layer.name
            self._grad_calls[name] = self._grad_calls.get(name, 0) + 1
            self._batch_grads[name] = self._batch_grads.get(name, 0) + 1
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            if self._batch_grads[name] == self._batch_forward.get(name, 0) * self.g_passes:
                self._timed(self._on_statistics, layer)
            last = self._micro_batches == self._accumulation_steps - 1
            expected = self._forward_calls.get(name, 0) * self.g_passes
            if last and self._grad_calls[name] == expected:
                self._on_layer_done(layer)

        return hook

    def _backward_end(self) -> None:
        self._callback_queued = False
        self._passes_done += 1
        if self._passes_done < self.g_passes:  # more Monte-Carlo passes of this batch
            return
        self._passes_done = 0
        self._micro_batches += 1
        self._on_micro_batch_end()
        self._batch_forward.clear()
        self._batch_grads.clear()
        if self._micro_batches >= self._accumulation_steps:
            self._on_backward_end()

    def _record_input(self, layer: CurvatureBlock, x: torch.Tensor, site: int) -> None:
        if self.pairs is not None:
            return  # handed over with its output gradient
        with torch.no_grad(), full_precision(x):
            layer.record_input(x, in_hook=self._in_hook, site=site)

    def _record_grad(
        self, layer: CurvatureBlock, d: torch.Tensor, x: torch.Tensor, site: int
    ) -> None:
        if self.pairs is not None:
            with torch.no_grad():
                self.pairs(layer, x.detach(), d, site)
            return
        divisor = self.divisor if self.divisor is not None else loss_scale(self._grad_scaler)
        with torch.no_grad(), full_precision(d):
            layer.record_output_grad(d, divisor, in_hook=self._in_hook, inputs=x, site=site)

    def _timed(self, fn: Callable[..., None], layer: CurvatureBlock, *args: Any) -> None:
        if torch.compiler.is_compiling():  # no host timers inside a compiled graph
            fn(layer, *args)
            return
        with timed(self._timings, "factors"):
            fn(layer, *args)


def compute_saved(layer: CurvatureBlock) -> None:
    """:meth:`~kaisa.blocks.CurvatureBlock.compute_saved` as the hooks compute statistics."""
    stats = layer.stats
    if stats.saved_inputs or stats.saved_grads:
        with torch.no_grad(), full_precision(layer.weight):
            layer.compute_saved()


def _in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform is running (its interpreter stack is not empty)."""
    return torch._C._functorch.peek_interpreter_stack() is not None
