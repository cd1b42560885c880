"""Validation and evaluation of hyperparameters that may be numbers or callables."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeAlias, TypeVar

__all__ = ["Schedule", "check_float", "check_int", "evaluate"]

T = TypeVar("T", int, float)
Schedule: TypeAlias = T | Callable[[int], T]


def check_float(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = False,
    high_inclusive: bool = True,
) -> None:
    """Validate a float hyperparameter (callables are checked when evaluated).

    Args:
        name: argument name used in the message.
        value: a real number or a callable of the step.
        low: lower bound, if any.
        high: upper bound, if any.
        low_inclusive: whether ``low`` itself is allowed.
        high_inclusive: whether ``high`` itself is allowed.

    Raises:
        ValueError: if the value is not a finite real number inside the bounds.
    """
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a callable of the step, got {value!r}")
    v = float(value)
    bad = not math.isfinite(v)
    if low is not None:
        bad = bad or (v < low if low_inclusive else v <= low)
    if high is not None:
        bad = bad or (v > high if high_inclusive else v >= high)
    if bad:
        lo = "[" if low is not None and low_inclusive else "("
        hi = "]" if high_inclusive else ")"
        rng = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
        raise ValueError(f"{name} must be in {rng}, got {value!r}")


def check_int(name: str, value: object, *, low: int = 1) -> None:
    """Validate an integer hyperparameter (callables are checked when evaluated).

    Args:
        name: argument name used in the message.
        value: an int or a callable of the step.
        low: smallest allowed value.

    Raises:
        ValueError: if the value is not an int ``>= low``.
    """
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def evaluate(name: str, value: Schedule[T], step: int, kind: type[T]) -> T:
    """Evaluate a hyperparameter at ``step``.

    Args:
        name: argument name used in the message.
        value: a number or a callable of the step.
        step: the current step.
        kind: ``int`` or ``float``.

    Returns:
        The value at ``step``, converted to ``kind``.

    Raises:
        ValueError: if a callable returns something that is not a number.
    """
    out = value(step) if callable(value) else value
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        raise ValueError(f"{name} evaluated at step {step} gave {out!r}, not a number")
    if kind is int and float(out) != int(out):
        raise ValueError(f"{name} evaluated at step {step} gave {out!r}, not an integer")
    return kind(out)
