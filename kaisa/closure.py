"""The closure :meth:`kaisa.KFAC.step` calls: what it returns, and a forward leaving no trace.

A closure runs a fresh forward pass of the model on the current batch and returns
``(outputs, targets)``: the outputs with their graph, and the targets the declared loss
compares them with (:mod:`kaisa.losses`: ``'mse'`` targets shaped like the outputs,
``'cross_entropy'`` class indices shaped like the outputs without their last, class,
dimension). :func:`call` checks that.

The Levenberg-Marquardt rule measures the loss after the update with one more forward
pass, in training mode so that its loss is comparable with the step's (batch statistics
in BatchNorm, the same dropout masks). :func:`preserved` runs it from the random state
the step's forward started from and then restores every buffer of the model (BatchNorm's
running statistics and ``num_batches_tracked``) and the random number generators: the
extra forward changes no module state and draws nothing from the global generators.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["Closure", "RandomState", "call", "full", "preserved", "random_state"]

Closure = Callable[[], tuple[torch.Tensor, torch.Tensor]]
#: The CPU generator's state and, where CUDA is initialised, every device's.
RandomState = tuple[torch.Tensor, list[torch.Tensor]]

_HALF = (torch.float16, torch.bfloat16)


def call(closure: Closure) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs ``closure`` and checks what it returned.

    Returns:
        ``(outputs, targets)``.

    Raises:
        TypeError: Unless it returned two tensors.
        ValueError: If the outputs carry no graph (detached, computed under
            ``torch.no_grad``, or outputs and targets swapped).
    """
    result = closure()
    if not (isinstance(result, tuple | list) and len(result) == 2
            and all(isinstance(t, torch.Tensor) for t in result)):
        got = (f"a {type(result).__name__} of {len(result)}"
               if isinstance(result, tuple | list) else f"a {type(result).__name__}")
        raise TypeError(
            "KFAC.step's closure must return (outputs, targets): the model's outputs from "
            f"a fresh forward pass and the targets of the loss, not the loss; got {got}"
        )
    outputs, targets = result
    if torch.is_grad_enabled() and not outputs.requires_grad:
        raise ValueError(
            "KFAC.step's closure returned outputs that do not require grad (detached, "
            "computed under torch.no_grad, or outputs and targets swapped?); return "
            "(model(x), targets)"
        )
    return outputs, targets


def full(outputs: torch.Tensor) -> torch.Tensor:
    """Half-precision outputs (autocast) as float32, for the loss and the quadratic model."""
    return outputs.float() if outputs.dtype in _HALF else outputs


def random_state() -> RandomState:
    """The global random number generators' states (CPU, and CUDA when initialised)."""
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if initialized else []
    return torch.get_rng_state(), cuda


def _set_random_state(state: RandomState) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


@contextmanager
def preserved(model: nn.Module, start: RandomState) -> Iterator[None]:
    """Runs the block from random state ``start``, then restores the model and generators.

    Args:
        model: Its buffers are restored afterwards (in place).
        start: The generators' state to run the block from (the step's forward's).
    """
    buffers = [(b, b.clone()) for b in model.buffers()]
    after = random_state()
    _set_random_state(start)
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        _set_random_state(after)
