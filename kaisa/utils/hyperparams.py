"""Validation and evaluation of hyperparameters that may be numbers or callables."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, TypeVar

__all__ = [
    "FLOAT_BOUNDS",
    "Schedule",
    "Schedules",
    "check_bounded",
    "check_count",
    "check_float",
    "check_int",
    "evaluate",
    "scheduled_float",
    "scheduled_int",
]

T = TypeVar("T", int, float)
Schedule: TypeAlias = T | Callable[[int], T]

#: (exclusive lower bound, inclusive upper bound) of the float hyperparameters.
FLOAT_BOUNDS: dict[str, tuple[float, float | None]] = {
    "damping": (0.0, None),
    "factor_decay": (0.0, 1.0),
    "kl_clip": (0.0, None),
    "lr": (0.0, None),
}


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


def check_bounded(name: str, value: object) -> None:
    """Validates a float hyperparameter against :data:`FLOAT_BOUNDS` (callables pass).

    Args:
        name: ``'damping'``, ``'factor_decay'``, ``'kl_clip'`` or ``'lr'``.
        value: A number or a callable of the step.

    Raises:
        ValueError: If the value is not a number inside the bounds.
    """
    low, high = FLOAT_BOUNDS[name]
    check_float(name, value, low=low, high=high)


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


def check_count(name: str, value: object) -> int:
    """Validates a saved counter (an ``int >= 0``, not a callable or a string).

    Args:
        name: The counter's name in the message.
        value: The saved value.

    Returns:
        The value.

    Raises:
        ValueError: Naming the counter and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state_dict {name} must be an integer >= 0, got {value!r}")
    return value


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


def scheduled_int(name: str, value: Schedule[int], step: int) -> int:
    """Evaluates an integer hyperparameter at ``step`` and checks it (``>= 1``).

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
    """Evaluates a float hyperparameter at ``step`` and checks it against :data:`FLOAT_BOUNDS`.

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
    check_bounded(name, out)
    return out


class Schedules:
    """Named hyperparameters of a product, each a number or a callable of the step.

    Both products keep theirs here: evaluated at a step with the checks above, replaced
    by schedulers, and saved in checkpoints when they are numbers (a callable stays the
    one the product was built with).

    Args:
        values: ``name -> number, callable or None``.
    """

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = dict(values)

    def names(self) -> tuple[str, ...]:
        """The hyperparameters' names."""
        return tuple(self._values)

    def raw(self, name: str) -> Any:
        """The value as given: a number, a callable or ``None``."""
        return self._values[name]

    def set(self, name: str, value: Any) -> None:
        """Replaces ``name`` (validated by the caller)."""
        self._values[name] = value

    def integer(self, name: str, step: int) -> int:
        """An integer hyperparameter at ``step`` (:func:`scheduled_int`)."""
        return scheduled_int(name, self._values[name], step)

    def real(self, name: str, step: int) -> float:
        """A float hyperparameter at ``step`` (:func:`scheduled_float`)."""
        return scheduled_float(name, self._values[name], step)

    def optional(self, name: str, step: int) -> float | None:
        """A float hyperparameter that may be ``None`` (disabled), at ``step``."""
        value = self._values[name]
        return None if value is None else scheduled_float(name, value, step)

    def state_dict(self) -> dict[str, Any]:
        """The values that are not callables."""
        return {name: v for name, v in self._values.items() if not callable(v)}

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raises ``ValueError`` unless every value :meth:`load_state_dict` would take is valid.

        A value must pass the constructor's checks (``kl_clip`` may be ``None``).
        """
        for name, current in self._values.items():
            if name not in state or callable(current):
                continue
            value = state[name]
            try:
                if callable(value):
                    raise ValueError(f"{name} must be a number, got {value!r}")
                if name not in FLOAT_BOUNDS:
                    check_int(name, value)
                elif value is not None or name != "kl_clip":
                    check_bounded(name, value)
            except ValueError as err:
                raise ValueError(f"state_dict {err}") from None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores saved values, except where this product holds a callable.

        Check them with :meth:`check_state_dict` first.
        """
        for name, value in self._values.items():
            if name in state and not callable(value):
                self._values[name] = state[name]
