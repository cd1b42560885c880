"""First-order update rules the products apply to their directions.

:func:`sgd_update` is ``torch.optim.SGD``'s rule (momentum, then weight decay added to
the direction) written once, so :class:`kaisa.KFAC`'s fixed mode equals
``KFACPreconditioner`` + ``torch.optim.SGD`` bit for bit; :func:`fixed_value` is the
``lr``/``momentum`` such a step uses. :func:`adam_moments` and :class:`AdamStep` are
``torch.optim.AdamW``'s arithmetic (``foreach=False``) written once: :func:`adamw_update`
applies it per parameter, and :class:`kaisa.EKFAC` in the Kronecker eigenbasis
(``docs/conventions.md``, "EKFAC").
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AdamStep", "adam_moments", "adamw_update", "fixed_value", "sgd_update", "step_count"]


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


def adam_moments(m: torch.Tensor, v: torch.Tensor, r: torch.Tensor, beta1: float,
                 beta2: float) -> None:
    """``m <- b1 m + (1 - b1) r``, ``v <- b2 v + (1 - b2) r^2`` in place (AdamW's ops)."""
    m.lerp_(r, 1 - beta1)
    v.mul_(beta2).addcmul_(r, r, value=1 - beta2)


@dataclass(frozen=True)
class AdamStep:
    """The scalars of one Adam step at step count ``step`` (after its increment).

    Attributes:
        lr: The learning rate.
        beta1: The first moment's decay.
        beta2: The second moment's decay.
        eps: Added to the denominator.
        step: The step count ``t`` (1 on the first step).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    step: float

    def update(self, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``(s m) / denom``: ``s = -lr / (1 - b1^t)``, ``denom = sqrt(v) / (1 - b2^t)^0.5 + eps``.

        What ``param.addcdiv_(exp_avg, denom, value=s)`` adds to the parameter, as a tensor.
        """
        bias_correction1 = 1 - self.beta1**self.step
        bias_correction2 = 1 - self.beta2**self.step
        denom = (v.sqrt() / bias_correction2**0.5).add_(self.eps)
        return torch.mul(m, -(self.lr / bias_correction1)).div_(denom)


def adamw_update(
    params: Sequence[torch.Tensor],
    state: MutableMapping[Any, dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """``torch.optim.AdamW``'s step (``foreach=False``) on each parameter with a ``.grad``.

    The per-parameter arithmetic of ``foreach=False``, bit for bit, as multi-tensor calls:
    the same element operations in the same order, over the parameters of one step count
    and device at a time.

    Args:
        params: The parameters.
        state: Per-parameter state as ``Optimizer.state`` (AdamW's ``step``, ``exp_avg``,
            ``exp_avg_sq``; created at the first step).
        lr: The learning rate.
        betas: ``(beta1, beta2)``.
        eps: Added to the denominator.
        weight_decay: The decoupled weight decay.
    """
    live = [p for p in params if p.grad is not None]
    if not live:
        return
    for p in live:
        own = state[p]
        if "step" not in own:
            own["step"] = step_count()
            own["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            own["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    counts = [state[p]["step"] for p in live]
    torch._foreach_add_(counts, 1)
    buckets: dict[tuple[float, torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p, t in zip(live, torch.stack(counts).tolist(), strict=True):
        buckets.setdefault((t, p.device, p.dtype), []).append(p)
    for (t, _, _), ps in buckets.items():
        m = [state[p]["exp_avg"] for p in ps]
        v = [state[p]["exp_avg_sq"] for p in ps]
        grads = [p.grad for p in ps]
        if weight_decay != 0:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        torch._foreach_lerp_(m, grads, 1 - betas[0])  # type: ignore[arg-type]
        torch._foreach_mul_(v, betas[1])
        torch._foreach_addcmul_(v, grads, grads, value=1 - betas[1])  # type: ignore[arg-type]
        step = AdamStep(lr, *betas, eps, t)
        bias_correction2 = 1 - step.beta2**step.step
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, bias_correction2**0.5)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_mul(m, -(lr / (1 - step.beta1**step.step)))
        torch._foreach_div_(update, denom)
        torch._foreach_add_(ps, update)


def step_count() -> torch.Tensor:
    """A new step count as AdamW keeps it: a 0-d tensor on the CPU, 0."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=dtype)
