"""The checkpoint of :class:`kaisa.KFAC`: what it saves beside torch's optimizer state.

``state_dict()['kaisa']`` holds the step counter, the damping, the Monte-Carlo sampler's
state and the curvature's (``'preconditioner'``: the step, the schedules' numbers and
the per-block ``'layers'``). :func:`checked` validates all of it, and the momentum
buffers of torch's part, before anything is loaded: a failed load changes nothing.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kaisa.core.checkpoint import check_generator_state
from kaisa.core.curvature import KFACCurvature
from kaisa.utils.hyperparams import Schedules, check_count
from kaisa.utils.optim_state import check_known, check_optimizer_state

__all__ = ["Checked", "checked", "saved"]


def saved(
    *, steps: int, damping: float, schedules: Schedules, curvature: KFACCurvature,
    generator: torch.Generator, first_order: torch.optim.Optimizer | None, gather: bool = False,
) -> dict[str, Any]:
    """The ``'kaisa'`` entry of :meth:`kaisa.KFAC.state_dict` (``gather``: the core's)."""
    state = {
        "preconditioner": {"steps": steps, **schedules.state_dict(),
                           "layers": curvature.state_dict(gather=gather)},
        "damping": damping,
        "steps": steps,
        "generator": generator.get_state(),
    }
    if first_order is not None:
        state["first_order"] = first_order.state_dict()
    return state


@dataclass(frozen=True)
class Checked:
    """The validated ``'kaisa'`` entry of a state dict, ready to load."""

    steps: int
    damping: float
    schedules: Mapping[str, Any]
    layers: Mapping[str, Any] | None
    generator: torch.Tensor
    first_order: dict[str, Any] | None


def checked(
    state_dict: object, *, schedules: Schedules, curvature: KFACCurvature,
    param_groups: list[dict[str, Any]], first_order: torch.optim.Optimizer | None,
) -> Checked:
    """Validates a :meth:`kaisa.KFAC.state_dict` for this optimizer.

    Args:
        state_dict: The saved state.
        schedules: The optimizer's schedules (they check their saved values).
        curvature: Its curvature core (it checks the per-block state).
        param_groups: Its parameter groups (momentum buffers must fit them).
        first_order: Its first-order optimizer (a copy loads the saved state first).

    Returns:
        The ``'kaisa'`` entry's parts.

    Raises:
        ValueError: Naming what is malformed or does not fit.
    """
    extra = state_dict.get("kaisa") if isinstance(state_dict, Mapping) else None
    if not isinstance(extra, Mapping) or not isinstance(extra.get("preconditioner"), Mapping):
        raise ValueError("state_dict has no 'kaisa' entry; not a kaisa.KFAC state dict")
    assert isinstance(state_dict, Mapping)
    saved = extra["preconditioner"]
    check_known("state_dict kaisa", extra,
                ("preconditioner", "damping", "steps", "generator", "first_order"))
    check_known("state_dict preconditioner", saved, ("steps", "layers", *schedules.names()))
    loaded = {"steps": extra.get("steps"), "damping": extra.get("damping"),
              **{name: saved.get(name) for name in schedules.names()}}
    curvature.check_same_on_ranks(loaded, what="loaded KFAC state")
    steps = check_count("steps", extra.get("steps"))
    damping = extra.get("damping")
    if isinstance(damping, bool) or not isinstance(damping, int | float) or not (
        math.isfinite(damping) and damping > 0
    ):
        raise ValueError(f"state_dict damping must be a finite number > 0, got {damping!r}")
    preconditioner = extra["preconditioner"]
    inner = check_count("preconditioner steps", preconditioner.get("steps"))
    if inner != steps:
        raise ValueError(f"state_dict preconditioner steps ({inner}) differ from its steps "
                         f"({steps})")
    schedules.check_state_dict(preconditioner)
    layers = preconditioner.get("layers")
    if layers is not None:
        curvature.check_state_dict(layers)
    generator = extra.get("generator")
    check_generator_state(generator)
    assert isinstance(generator, torch.Tensor)
    check_optimizer_state(state_dict, param_groups)
    rule = extra.get("first_order")
    if (first_order is None) != (rule is None):
        raise ValueError(
            "state_dict first_order does not fit: saved "
            f"{'with' if rule is not None else 'without'} a first-order optimizer, this KFAC "
            f"has {'one' if first_order is not None else 'none'} (another lr mode or coverage?)"
        )
    if first_order is not None and rule is not None:
        if not isinstance(rule, dict):
            raise ValueError(f"state_dict first_order is a {type(rule).__name__}, not a dict")
        check_optimizer_state(rule, first_order.param_groups, what="state_dict first_order",
                              strict_groups=False)
        try:
            copy.deepcopy(first_order).load_state_dict(rule)
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise ValueError(f"state_dict first_order does not fit ({err})") from None
    return Checked(steps, float(damping), preconditioner, layers, generator, rule)
