"""Forward-mode tangents for parameters FSDP2 shards, one unit at a time.

:class:`kaisa.KFAC`'s quadratic model needs ``J v``
(:class:`kaisa.kfac.quadratic.ForwardLinearization`): a replayed forward pass with dual
parameters ``theta + eps v``. Under FSDP2
(``fully_shard``) a parameter is a ``DTensor`` shard; each unit (a module ``fully_shard``
wrapped) all-gathers its parameters in a forward pre-hook and sets the unsharded ones on
their modules, which ``functional_call`` cannot override. :class:`UnitTangents` therefore
installs the dual parameters from inside each unit's forward: a pre-hook that runs after
FSDP2's all-gather gathers the unit's tangents (``DTensor.full_tensor``: one unit's at a
time, never the whole model's) and sets ``make_dual(unsharded, tangent)`` on every module
that holds the parameter (tied ones too); a hook before FSDP2's post-forward puts the
unsharded parameters back. The values are the same as the unsharded model's dual
parameters, so ``J v`` is the one process's up to the order of sums.

:func:`reshard` returns every unit to its sharded state after a forward pass without
grad mode (FSDP2 keeps the root's parameters unsharded after one, and would then neither
all-gather updated shards nor let ``model.parameters()`` return the sharded parameters).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.autograd.forward_ad as fwad
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

__all__ = ["UnitTangents", "reshard"]

#: Where a parameter is registered: ``(module, attribute name)``.
Location = tuple[nn.Module, str]


def reshard(model: nn.Module) -> None:
    """Reshards every FSDP2 unit of ``model`` (nothing for a model FSDP2 does not wrap)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _unit_of(model: nn.Module, module_name: str) -> nn.Module:
    """The innermost FSDP2 unit holding the module ``module_name`` (itself included)."""
    parts = module_name.split(".") if module_name else []
    for depth in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:depth]))
        if isinstance(candidate, FSDPModule):
            return candidate
    raise ValueError(
        f"parameter of module {module_name!r} is a DTensor but no fully_shard unit holds "
        "it: kaisa supports DTensor parameters from FSDP2 (fully_shard) only"
    )


class UnitTangents:
    """Dual parameters for the ``DTensor`` parameters of a model FSDP2 shards.

    Args:
        model: The model (``fully_shard`` on its units).
        params: The sharded parameters tangents will be given for.
        names: Every name of each parameter, by ``id`` (tied parameters have several).

    Raises:
        ValueError: If a parameter is not held by a ``fully_shard`` unit, or is held
            by modules of two different units.
    """

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor],
                 names: Mapping[int, Sequence[str]]) -> None:
        self._units: dict[int, tuple[nn.Module, list[tuple[int, list[Location]]]]] = {}
        for index, p in enumerate(params):
            locations: list[Location] = []
            units = set()
            for name in names[id(p)]:
                module_name, _, attr = name.rpartition(".")
                unit = _unit_of(model, module_name)
                units.add(id(unit))
                locations.append((model.get_submodule(module_name), attr))
            if len(units) != 1:
                raise ValueError(
                    f"parameter {names[id(p)][0]!r} is used by modules of {len(units)} "
                    "fully_shard units: kaisa.KFAC needs each sharded parameter in one unit"
                )
            entry = self._units.setdefault(id(unit), (unit, []))
            entry[1].append((index, locations))

    @contextmanager
    def installed(self, tangents: Sequence[torch.Tensor]) -> Iterator[None]:
        """Within the block, each unit's forward pass sees ``make_dual(p, tangent)``.

        Args:
            tangents: One ``DTensor`` per parameter, laid out as the parameter. Call
                inside ``fwad.dual_level()``; every rank must run the same forward
                (each unit gathers its tangents, a collective).
        """
        handles = []
        try:
            for unit, entries in self._units.values():
                saved: list[tuple[nn.Module, str, Any]] = []
                handles.append(unit.register_forward_pre_hook(
                    _installer(entries, tangents, saved)))
                handles.append(unit.register_forward_hook(_restorer(saved), prepend=True))
            yield
        finally:
            for handle in handles:
                handle.remove()


def _installer(entries: list[tuple[int, list[Location]]], tangents: Sequence[torch.Tensor],
               saved: list[tuple[nn.Module, str, Any]]) -> Any:
    """A pre-hook that sets the unit's dual parameters (after FSDP2's all-gather)."""

    def hook(_unit: nn.Module, _args: Any) -> None:
        for index, locations in entries:
            module, attr = locations[0]
            unsharded = module._parameters[attr]
            assert unsharded is not None and not isinstance(unsharded, DTensor)
            tangent = tangents[index]
            full = tangent.full_tensor() if isinstance(tangent, DTensor) else tangent
            dual = fwad.make_dual(  # type: ignore[no-untyped-call]
                unsharded.detach(), full.to(unsharded.dtype))
            for holder, name in locations:
                saved.append((holder, name, holder._parameters[name]))
                holder._parameters[name] = dual

    return hook


def _restorer(saved: list[tuple[nn.Module, str, Any]]) -> Any:
    """A forward hook that puts the unsharded parameters back (before FSDP2's reshard)."""

    def hook(_unit: nn.Module, _args: Any, _output: Any) -> None:
        while saved:
            holder, name, value = saved.pop()
            holder._parameters[name] = value

    return hook
