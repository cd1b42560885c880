"""The closure :meth:`kaisa.KFAC.step` calls: what it returns, and a forward leaving no trace.

A closure runs a fresh forward pass of the model on the current batch and returns
``(outputs, targets)``: the outputs with their graph, and the targets the declared loss
compares them with (:mod:`kaisa.kfac.losses`: ``'mse'`` targets shaped like the outputs,
``'cross_entropy'`` class indices shaped like the outputs without their last, class,
dimension). :func:`call` checks that.

The Levenberg-Marquardt rule measures the loss after the update with one more forward
pass, in training mode so that its loss is comparable with the step's (batch statistics
in BatchNorm, the same dropout masks), replayed by :func:`kaisa.kfac.replay.replayed`: from the
random state the step's forward started from, and restoring every buffer of the model
(BatchNorm's running statistics and ``num_batches_tracked``) and the random number
generators afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kaisa.kfac.amp import full_precision_outputs
from kaisa.kfac.losses import Loss
from kaisa.kfac.replay import RandomState, replayed

__all__ = ["Closure", "call", "replayed_loss"]

Closure = Callable[[], tuple[torch.Tensor, torch.Tensor]]


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


def replayed_loss(
    model: nn.Module, closure: Closure, loss: Loss, start: RandomState
) -> torch.Tensor:
    """The loss of a forward pass replaying the step's (from ``start``), float64, no graph.

    The Levenberg-Marquardt rule's ``L(theta + delta)``: the same dropout masks, and no
    module state or random stream changes (:func:`kaisa.kfac.replay.replayed`).
    """
    with torch.no_grad(), replayed(model, start):
        outputs, targets = call(closure)
        return loss(full_precision_outputs(outputs), targets).detach().double()
