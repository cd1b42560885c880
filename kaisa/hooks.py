"""Recording K-FAC statistics: module hooks, micro-batch counting, end of backward.

:class:`StatisticsRecorder` puts a forward hook on every registered module. While
recording (training mode, gradients on, :attr:`StatisticsRecorder.recording` set by the
curvature core for a factor-update step), the forward hook turns the
module's input into a batch A factor (or keeps the input when factors are computed in
``step()``) and hooks the output's gradient, which turns into a batch G factor. It counts
forward calls and output gradients per layer and micro-batches per step, and tells its
listener

* ``on_layer_done(layer)`` as soon as a layer's last output gradient of the step's last
  micro-batch has been recorded (the engine starts that layer's factor allreduce while
  the rest of the backward pass runs), and
* ``on_backward_end()`` at the end of the last micro-batch's backward pass.

Under ``torch.compile`` the hooks make no timing calls (``time.perf_counter`` would break
the graph); timings then cover only eager execution. Dynamo traces the output-gradient
hook when it is registered, and its updates of Python state cost graph breaks around
each registered layer (torch 2.13: 3 for a conv + linear model); results equal eager
execution (tests/test_compile.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from kaisa.blocks import CurvatureBlock

__all__ = ["StatisticsRecorder", "full_precision", "loss_scale"]


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
    without a graph break.
    """
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(device_type=t.device.type, enabled=False)
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
    ) -> None:
        self._layers = layers
        self._in_hook = in_hook
        self._grad_scaler = grad_scaler
        self._accumulation_steps = accumulation_steps
        self._on_layer_done = on_layer_done
        self._on_backward_end = on_backward_end
        self._timings = timings
        #: Whether forward passes record statistics (a factor-update step).
        self.recording = False
        #: Backward passes per recorded forward that record G (Monte-Carlo samples); 0
        #: for backward passes that must not contribute G (the true loss's, when G comes
        #: from sampled targets).
        self.g_passes = 1
        #: What output gradients are divided by; ``None``: the grad scaler's loss scale.
        self.divisor: float | torch.Tensor | None = None
        self._forward_calls: dict[str, int] = {}
        self._grad_calls: dict[str, int] = {}
        self._micro_batches = 0
        self._passes_done = 0
        self._callback_queued = False
        self._handles = [
            layer.module.register_forward_hook(self._forward_hook(layer))
            for layer in layers.values()
        ]

    def remove(self) -> None:
        """Detaches every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def end_step(self) -> None:
        """Resets the per-step counters."""
        self._forward_calls.clear()
        self._grad_calls.clear()
        self._micro_batches = 0
        self._passes_done = 0

    def compute_saved(self) -> None:
        """Turns kept inputs / output gradients into batch factors (``in_hook=False``)."""
        for layer in self._layers.values():
            stats = layer.stats
            if not (stats.saved_inputs or stats.saved_grads):
                continue
            with torch.no_grad(), full_precision(layer.weight):
                for x in stats.saved_inputs:
                    stats.add_a(layer.compute_a_batch(x))
                for d, divisor in stats.saved_grads:
                    stats.add_g(layer.compute_g_batch(d, divisor))
            stats.saved_inputs.clear()
            stats.saved_grads.clear()

    # ------------------------------------------------------------------ hooks
    def _forward_hook(
        self, layer: CurvatureBlock
    ) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not (module.training and torch.is_grad_enabled() and self.recording):
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            if not args or not isinstance(args[0], torch.Tensor):
                return  # e.g. a keyword-only call: nothing to record, never raise
            name = layer.name
            self._forward_calls[name] = self._forward_calls.get(name, 0) + 1
            x = args[0].detach()
            self._timed(self._record_input, layer, x)
            output.register_hook(self._grad_hook(layer, x))  # type: ignore[no-untyped-call]

        return hook

    def _grad_hook(
        self, layer: CurvatureBlock, x: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.g_passes == 0:
                return
            self._timed(self._record_grad, layer, grad.detach(), x)
            if not self._in_hook:
                return
            name = layer.name
            self._grad_calls[name] = self._grad_calls.get(name, 0) + 1
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
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
        if self._micro_batches >= self._accumulation_steps:
            self._on_backward_end()

    def _record_input(self, layer: CurvatureBlock, x: torch.Tensor) -> None:
        with torch.no_grad(), full_precision(x):
            layer.record_input(x, in_hook=self._in_hook)

    def _record_grad(self, layer: CurvatureBlock, d: torch.Tensor, x: torch.Tensor) -> None:
        divisor = self.divisor if self.divisor is not None else loss_scale(self._grad_scaler)
        with torch.no_grad(), full_precision(d):
            layer.record_output_grad(d, divisor, in_hook=self._in_hook, inputs=x)

    def _timed(
        self, fn: Callable[..., None], layer: CurvatureBlock, *tensors: torch.Tensor
    ) -> None:
        if torch.compiler.is_compiling():  # no host timers inside a compiled graph
            fn(layer, *tensors)
            return
        start = time.perf_counter()
        fn(layer, *tensors)
        self._timings["factors"] += time.perf_counter() - start
