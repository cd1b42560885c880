"""Validation and parsing of the :class:`~kaisa.KFACPreconditioner` constructor arguments.

:func:`parse_arguments` checks every argument, raising a ``ValueError`` whose message
names the offending argument, and returns the parsed values as a frozen
:class:`KFACArguments`. Hyperparameters given as callables of the step are checked when
they are evaluated, by :func:`scheduled_int` and :func:`scheduled_float`, against the
same bounds; :func:`loss_scale` reads the current scale of a ``grad_scaler``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kaisa.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, parse_enum
from kaisa.hyperparams import Schedule, check_float, check_int, evaluate

__all__ = [
    "HYPERPARAMETERS",
    "KFACArguments",
    "loss_scale",
    "parse_arguments",
    "scheduled_float",
    "scheduled_int",
]

#: Hyperparameters that may be numbers or callables of the step.
HYPERPARAMETERS = (
    "factor_update_steps",
    "inv_update_steps",
    "damping",
    "factor_decay",
    "kl_clip",
    "lr",
)

# (exclusive lower bound, inclusive upper bound) of the float hyperparameters.
_FLOAT_BOUNDS: dict[str, tuple[float, float | None]] = {
    "damping": (0.0, None),
    "factor_decay": (0.0, 1.0),
    "kl_clip": (0.0, None),
    "lr": (0.0, None),
}

_FLAGS = (
    "colocate_factors",
    "compute_eigenvalue_outer_product",
    "symmetry_aware",
    "update_factors_in_hook",
)


@dataclass(frozen=True)
class KFACArguments:
    """The validated constructor arguments of :class:`~kaisa.KFACPreconditioner`.

    Attributes:
        factor_update_steps: Steps between factor updates (int or callable).
        inv_update_steps: Steps between decomposition updates (int or callable).
        damping: Damping (float or callable).
        factor_decay: Running-average decay (float or callable).
        kl_clip: KL-clip threshold (float or callable), ``None`` disables clipping.
        lr: Learning rate used by KL clipping (float or callable).
        accumulation_steps: Micro-batches per optimisation step.
        allreduce_bucket_cap_mb: Fusion bucket capacity of the communicator.
        assignment_strategy: Cost model for placing decompositions.
        colocate_factors: Whether the A and G decompositions of a layer share a rank.
        compute_method: Eigendecompositions or inverses.
        compute_eigenvalue_outer_product: Whether the eigenvalue outer product is stored.
        grad_worker_fraction: A :class:`DistributedStrategy`, a float in ``(0, 1]`` or
            ``'auto'``.
        memory_budget_mb: Per-rank budget for ``grad_worker_fraction='auto'``, else
            ``None``.
        symmetry_aware: Whether symmetric matrices are sent as upper triangles.
        grad_scaler: A gradient scaler, a callable returning the loss scale, or ``None``.
        factor_dtype: Factor dtype, ``None`` to follow the activations (at least
            float32).
        inv_dtype: Storage dtype of the decompositions.
        skip_layers: Regular expressions of module names or class names not to register.
        skip_patterns: ``skip_layers``, compiled.
        update_factors_in_hook: Whether factors are computed in the hooks (else in
            :meth:`~kaisa.KFACPreconditioner.step`).
        loglevel: Logging level of the informational messages.
    """

    factor_update_steps: Schedule[int]
    inv_update_steps: Schedule[int]
    damping: Schedule[float]
    factor_decay: Schedule[float]
    kl_clip: Schedule[float] | None
    lr: Schedule[float]
    accumulation_steps: int
    allreduce_bucket_cap_mb: float
    assignment_strategy: AssignmentStrategy
    colocate_factors: bool
    compute_method: ComputeMethod
    compute_eigenvalue_outer_product: bool
    grad_worker_fraction: DistributedStrategy | float | str
    memory_budget_mb: float | None
    symmetry_aware: bool
    grad_scaler: Any
    factor_dtype: torch.dtype | None
    inv_dtype: torch.dtype
    skip_layers: tuple[str, ...]
    skip_patterns: tuple[re.Pattern[str], ...]
    update_factors_in_hook: bool
    loglevel: int


def parse_arguments(
    model: object,
    *,
    factor_update_steps: Schedule[int],
    inv_update_steps: Schedule[int],
    damping: Schedule[float],
    factor_decay: Schedule[float],
    kl_clip: Schedule[float] | None,
    lr: Schedule[float],
    accumulation_steps: int,
    allreduce_bucket_cap_mb: float,
    assignment_strategy: AssignmentStrategy | str,
    colocate_factors: bool,
    compute_method: ComputeMethod | str,
    compute_eigenvalue_outer_product: bool,
    grad_worker_fraction: DistributedStrategy | float | str,
    memory_budget_mb: float | None,
    symmetry_aware: bool,
    grad_scaler: Any,
    factor_dtype: torch.dtype | None,
    inv_dtype: torch.dtype,
    skip_layers: str | list[str] | None,
    update_factors_in_hook: bool,
    loglevel: int,
) -> KFACArguments:
    """Validates the constructor arguments of :class:`~kaisa.KFACPreconditioner`.

    Args:
        model: The model; it must be a ``torch.nn.Module`` (it is not stored).
        factor_update_steps: See :class:`KFACArguments`.
        inv_update_steps: See :class:`KFACArguments`.
        damping: See :class:`KFACArguments`.
        factor_decay: See :class:`KFACArguments`.
        kl_clip: See :class:`KFACArguments`.
        lr: See :class:`KFACArguments`.
        accumulation_steps: See :class:`KFACArguments`.
        allreduce_bucket_cap_mb: See :class:`KFACArguments`.
        assignment_strategy: An :class:`AssignmentStrategy` or its name.
        colocate_factors: See :class:`KFACArguments`.
        compute_method: A :class:`ComputeMethod` or its name.
        compute_eigenvalue_outer_product: See :class:`KFACArguments`.
        grad_worker_fraction: A :class:`DistributedStrategy` (or its name), a float in
            ``(0, 1]`` or ``'auto'``.
        memory_budget_mb: Required with ``grad_worker_fraction='auto'``, else ``None``.
        symmetry_aware: See :class:`KFACArguments`.
        grad_scaler: See :class:`KFACArguments`.
        factor_dtype: See :class:`KFACArguments`.
        inv_dtype: See :class:`KFACArguments`.
        skip_layers: A regular expression, a list of them, or ``None``.
        update_factors_in_hook: See :class:`KFACArguments`.
        loglevel: See :class:`KFACArguments`.

    Returns:
        The parsed arguments.

    Raises:
        ValueError: If an argument is invalid; the message names the argument.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_int("factor_update_steps", factor_update_steps)
    check_int("inv_update_steps", inv_update_steps)
    _check_scheduled_float("damping", damping)
    _check_scheduled_float("factor_decay", factor_decay)
    if kl_clip is not None:
        _check_scheduled_float("kl_clip", kl_clip)
    _check_scheduled_float("lr", lr)
    check_int("accumulation_steps", accumulation_steps)
    check_float("allreduce_bucket_cap_mb", allreduce_bucket_cap_mb, low=0.0, low_inclusive=True)
    if callable(allreduce_bucket_cap_mb):
        raise ValueError("allreduce_bucket_cap_mb must be a number")
    flags = (colocate_factors, compute_eigenvalue_outer_product, symmetry_aware)
    for flag, value in zip(_FLAGS, (*flags, update_factors_in_hook), strict=True):
        if not isinstance(value, bool):
            raise ValueError(f"{flag} must be a bool, got {value!r}")
    method = parse_enum(ComputeMethod, compute_method, "compute_method")
    assignment = parse_enum(AssignmentStrategy, assignment_strategy, "assignment_strategy")
    fraction = _parse_fraction(grad_worker_fraction)
    if fraction == "auto":
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
    if grad_scaler is not None and not (callable(grad_scaler) or hasattr(grad_scaler, "get_scale")):
        raise ValueError(
            "grad_scaler must be a torch.amp.GradScaler, torch.cuda.amp.GradScaler or a "
            f"callable returning the loss scale, got {type(grad_scaler).__name__}"
        )
    if not isinstance(loglevel, int):
        raise ValueError(f"loglevel must be an int logging level, got {loglevel!r}")
    patterns = _parse_skip_layers(skip_layers)
    try:
        regexes = tuple(re.compile(p) for p in patterns)
    except re.error as err:
        raise ValueError(f"skip_layers has an invalid regular expression: {err}") from None
    return KFACArguments(
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        damping=damping,
        factor_decay=factor_decay,
        kl_clip=kl_clip,
        lr=lr,
        accumulation_steps=accumulation_steps,
        allreduce_bucket_cap_mb=float(allreduce_bucket_cap_mb),
        assignment_strategy=assignment,
        colocate_factors=colocate_factors,
        compute_method=method,
        compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
        grad_worker_fraction=fraction,
        memory_budget_mb=memory_budget_mb,
        symmetry_aware=symmetry_aware,
        grad_scaler=grad_scaler,
        factor_dtype=factor_dtype,
        inv_dtype=inv_dtype,
        skip_layers=patterns,
        skip_patterns=regexes,
        update_factors_in_hook=update_factors_in_hook,
        loglevel=loglevel,
    )


def scheduled_int(name: str, value: Schedule[int], step: int) -> int:
    """Evaluates an integer hyperparameter at ``step`` and checks it.

    Args:
        name: ``'factor_update_steps'`` or ``'inv_update_steps'``.
        value: An int or a callable of the step.
        step: The current step.

    Returns:
        The value at ``step``.

    Raises:
        ValueError: If the value is not an integer ``>= 1``.
    """
    out = evaluate(name, value, step, int)
    check_int(name, out)
    return out


def scheduled_float(name: str, value: Schedule[float], step: int) -> float:
    """Evaluates a float hyperparameter at ``step`` and checks its bounds.

    Args:
        name: ``'damping'``, ``'factor_decay'``, ``'kl_clip'`` or ``'lr'``.
        value: A number or a callable of the step.
        step: The current step.

    Returns:
        The value at ``step``.

    Raises:
        ValueError: If the value is not a number inside the hyperparameter's bounds.
    """
    out = evaluate(name, value, step, float)
    _check_scheduled_float(name, out)
    return out


def loss_scale(grad_scaler: Any) -> float | torch.Tensor:
    """The current loss scale of a validated ``grad_scaler`` argument.

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


def _check_scheduled_float(name: str, value: object) -> None:
    low, high = _FLOAT_BOUNDS[name]
    check_float(name, value, low=low, high=high)


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


def _parse_skip_layers(skip_layers: object) -> tuple[str, ...]:
    if skip_layers is None:
        return ()
    if isinstance(skip_layers, str):
        return (skip_layers,)
    if isinstance(skip_layers, (list, tuple)) and all(isinstance(p, str) for p in skip_layers):
        return tuple(skip_layers)
    raise ValueError(f"skip_layers must be a str or a list of str, got {skip_layers!r}")
