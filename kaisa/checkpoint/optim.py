"""Optimizer state keyed by parameter name, for :mod:`kaisa.checkpoint`.

``get_optimizer_state_dict`` keys a torch optimizer's state by the model's parameter
names, so that a checkpoint does not depend on the order of the parameters or on the
world size. It fills an empty state by stepping the optimizer on zero gradients, which
kaisa's own optimizers cannot take (:class:`~kaisa.EKFAC`'s step updates its curvature,
:class:`~kaisa.KFAC`'s needs a closure). These functions convert the same layout
(``{'state': {name: {entry: tensor}}, 'param_groups': [{..., 'params': [name, ...]}]}``)
without a step, for those optimizers and for :class:`~kaisa.KFAC`'s first-order one:

* :func:`named` gives it (the optimizer's own tensors, ``DTensor`` shards under FSDP2);
* :func:`template` the buffers a load reads the saved entries into, sharded like the
  parameters where the saved entry has the parameter's shape;
* :func:`indexed` turns a loaded one back into ``torch.optim.Optimizer.load_state_dict``'s
  layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = ["entries", "fqns", "indexed", "named", "template"]


def entries(saved: Mapping[str, STORAGE_TYPES], prefix: str) -> dict[str, TensorStorageMetadata]:
    """The tensors saved under ``prefix`` one level down (``prefix`` ends with a dot)."""
    return {fqn[len(prefix):]: md for fqn, md in saved.items()
            if fqn.startswith(prefix) and "." not in fqn[len(prefix):]
            and isinstance(md, TensorStorageMetadata)}


def fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of every optimizer parameter, in the optimizer's order.

    Raises:
        ValueError: If the optimizer holds a parameter that is not the model's.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # a tied one: its first name
    try:
        return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the model's") from None


def named(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The torch part of ``optimizer``'s state keyed by parameter name (no copies)."""
    state = torch.optim.Optimizer.state_dict(optimizer)
    names = fqns(model, optimizer)
    return {"state": {names[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def template(model: nn.Module, optimizer: torch.optim.Optimizer,
             saved: Mapping[str, STORAGE_TYPES], prefix: str) -> dict[str, Any]:
    """Buffers for the state saved under ``prefix`` (``'optim.'``), one per saved entry.

    An entry of its parameter's shape is a zero ``DTensor`` sharded like the parameter
    (each rank reads its rows), any other (a step count) a plain tensor; the parameter
    groups are the current ones (DCP replaces them by the saved ones).
    """
    names = fqns(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, p in zip(names, params, strict=True):
        state[fqn] = {
            key: (torch.zeros_like(p, dtype=md.properties.dtype)
                  if isinstance(p, DTensor) and md.size == p.shape
                  else torch.zeros(md.size, dtype=md.properties.dtype))
            for key, md in entries(saved, f"{prefix}state.{fqn}.").items()
        }
    return {"state": {k: v for k, v in state.items() if v},
            "param_groups": named(model, optimizer)["param_groups"]}


def indexed(model: nn.Module, optimizer: torch.optim.Optimizer,
            state: Mapping[str, Any]) -> dict[str, Any]:
    """A :func:`named` state in ``optimizer.load_state_dict``'s layout (indices).

    Raises:
        ValueError: If it names a parameter ``optimizer`` does not hold.
    """
    index = {fqn: i for i, fqn in enumerate(fqns(model, optimizer))}

    def at(fqn: str) -> int:
        if fqn not in index:
            raise ValueError(f"the checkpoint's optimizer state names parameter {fqn!r}, "
                             "which this optimizer does not hold")
        return index[fqn]

    return {"state": {at(fqn): dict(v) for fqn, v in state["state"].items()},
            "param_groups": [{**g, "params": [at(f) for f in g["params"]]}
                             for g in state["param_groups"]]}
