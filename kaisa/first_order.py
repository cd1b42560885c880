"""First-order update rules the products apply to their directions.

:func:`sgd_update` is ``torch.optim.SGD``'s rule (momentum, then weight decay added to
the direction) written once, so :class:`kaisa.KFAC`'s fixed mode equals
``KFACPreconditioner`` + ``torch.optim.SGD`` bit for bit; :func:`fixed_value` is the
``lr``/``momentum`` such a step uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["fixed_value", "sgd_update"]


def fixed_value(
    name: str, schedule: float | Callable[[int], float] | str,
    param_groups: list[dict[str, Any]], step: int,
) -> float:
    """A fixed ``lr``/``momentum`` at ``step``.

    A callable's value (written into the param groups), else the param group's (which
    LR schedulers may change).

    Raises:
        ValueError: If it is not a finite number ``>= 0``.
    """
    if callable(schedule):
        value = float(schedule(step))
        for group in param_groups:
            group[name] = value
    value = float(param_groups[0][name])
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} at step {step} is {value}, not a number >= 0")
    return value


def sgd_update(
    params: Sequence[torch.Tensor],
    state: MutableMapping[Any, dict[str, Any]],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """``p -= lr * buf`` with ``buf = momentum * buf + (p.grad + weight_decay * p)``.

    Args:
        params: The parameters (those without ``.grad`` are skipped).
        state: Per-parameter state (``momentum_buffer``), as ``Optimizer.state``.
        lr: The learning rate.
        momentum: The momentum (0: none, no buffer).
        weight_decay: The L2 coefficient.
    """
    for p in params:
        if p.grad is None:
            continue
        d_p = p.grad
        if weight_decay:
            d_p = d_p.add(p, alpha=weight_decay)
        if momentum:
            buf = state[p].get("momentum_buffer")
            if buf is None:
                buf = torch.clone(d_p).detach()
                state[p]["momentum_buffer"] = buf
            else:
                buf.mul_(momentum).add_(d_p)
            d_p = buf
        p.add_(d_p, alpha=-lr)
