"""Checks of a saved torch optimizer state (``state``, ``param_groups``) before it loads.

``torch.optim.Optimizer.load_state_dict`` checks the number of groups and parameters only:
a moment of another shape, a string learning rate or a per-parameter entry that is not a
dict would load and fail (or silently broadcast) at the next step. :func:`check_optimizer_state`
checks every field against the optimizer's current groups first, so that a product can
refuse the whole state before anything changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kaisa.utils.finite import all_finite

__all__ = ["PARAMETER_SHAPED", "check_known", "check_optimizer_state"]

#: Per-parameter entries that have their parameter's shape (SGD, Adam(W), KFAC, EKFAC).
PARAMETER_SHAPED = ("velocity", "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def check_optimizer_state(
    state_dict: Mapping[str, Any], param_groups: Sequence[Mapping[str, Any]], *,
    what: str = "state_dict", strict_groups: bool = True,
) -> None:
    """Raises ``ValueError`` naming the first field of ``state_dict`` that does not fit.

    Args:
        state_dict: A saved ``{'state': {index: {name: value}}, 'param_groups': [...]}``.
        param_groups: The optimizer's current groups (with their parameters).
        what: How the message names the state.
        strict_groups: Also refuse a saved group without one of the current group's
            settings (kaisa's own optimizers); else only the settings both have are checked
            (a torch optimizer's flags may differ between torch versions).
    """
    state, groups = state_dict.get("state"), state_dict.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list):
        raise ValueError(f"{what} has no optimizer 'state' (a dict) and 'param_groups' "
                         "(a list)")
    if len(groups) != len(param_groups):
        raise ValueError(f"{what} has {len(groups)} param groups, this optimizer "
                         f"{len(param_groups)}")
    params: dict[int, torch.Tensor] = {}
    for i, (saved, group) in enumerate(zip(groups, param_groups, strict=True)):
        where = f"{what} param_groups[{i}]"
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where} is a {type(saved).__name__}, not a dict")
        indices = saved.get("params")
        if not isinstance(indices, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in indices
        ) or len(indices) != len(group["params"]):
            raise ValueError(f"{where} params must be a list of {len(group['params'])} "
                             f"parameter indices, got {indices!r}")
        params.update(zip(indices, group["params"], strict=True))
        for key, current in group.items():
            if key == "params":
                continue
            if key not in saved:
                if strict_groups:
                    raise ValueError(f"{where} has no {key!r}")
                continue
            _check_setting(f"{where} {key}", saved[key], current)
    for index, entries in state.items():
        p = params.get(index) if isinstance(index, int) else None
        if p is None:
            raise ValueError(f"{what} state names parameter {index!r}, which no group holds")
        if not isinstance(entries, Mapping):
            raise ValueError(f"{what} state of parameter {index} is a "
                             f"{type(entries).__name__}, not a dict")
        for name, value in entries.items():
            _check_entry(f"{what} {name} of parameter {index}", name, value, p)


def check_known(where: str, state: Mapping[str, Any], known: Sequence[str]) -> None:
    """Raises ``ValueError`` if ``state`` has entries outside ``known`` (naming them)."""
    unknown = sorted(str(k) for k in state if k not in known)
    if unknown:
        raise ValueError(f"{where} has unexpected entries {unknown} (expected some of "
                         f"{sorted(known)})")


def _check_setting(where: str, value: object, current: object) -> None:
    """A group setting must be of the current value's kind (number, flag, tuple, ...)."""
    def number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    if number(current) or isinstance(current, torch.Tensor):
        ok = number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    elif isinstance(current, tuple | list):
        ok = (isinstance(value, tuple | list) and len(value) == len(current)
              and all(number(v) for v in value))
    elif isinstance(current, bool | str):
        ok = type(value) is type(current)
    else:
        ok = True  # None (torch's unset flags) or a setting of its own kind: torch's to check
    if not ok:
        raise ValueError(f"{where} must be like {current!r}, got {value!r}")


def _check_entry(where: str, name: str, value: object, p: torch.Tensor) -> None:
    """A per-parameter entry: a tensor of the parameter's shape, or a finite step count."""
    if name in PARAMETER_SHAPED:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise ValueError(f"{where} must be a floating-point tensor, got "
                             f"{type(value).__name__}"
                             + (f" of {value.dtype}" if isinstance(value, torch.Tensor) else ""))
        if value.shape != p.shape:
            raise ValueError(f"{where} is {tuple(value.shape)!r}, the parameter's shape is "
                             f"{tuple(p.shape)}")
        if not bool(all_finite(value)):
            raise ValueError(f"{where} is not finite")
        return
    if name == "step":
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and value >= 0) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
            and bool(torch.isfinite(value).all()) and float(value) >= 0)
        if not ok:
            raise ValueError(f"{where} must be a count >= 0, got {value!r}")
        return
    if not isinstance(value, torch.Tensor | int | float) or isinstance(value, bool):
        raise ValueError(f"{where} must be a tensor or a number, got {type(value).__name__}")
