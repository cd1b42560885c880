"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds three parts, keyed by names that do not depend on the world size:

* ``'model'``: :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`
  (under FSDP2 each rank writes its shards of the ``DTensor`` parameters);
* ``'optim'``: the optimizer's state keyed by parameter name, as
  :func:`~torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gives it
  (for :class:`kaisa.EKFAC`, its AdamW state, converted the same way);
* ``'kfac'``: the K-FAC state. ``'kfac.meta'`` (every rank the same, written once) holds
  the product, its blocks (name, kind, dims), the step counters and the schedules'
  numbers; ``'kfac.layers.<block>.<entry>'`` the tensors. Each rank contributes only
  what the placement makes it the owner of: a block's ``A`` factor (and its skip count)
  by the rank that decomposes it, ``G`` likewise, the decompositions (eigenbases,
  eigenvalues or inverses, and :class:`~kaisa.EKFAC`'s moments) by the block's first
  gradient worker, so DCP writes every key once and no rank gathers anything.

Loading reads the checkpoint's metadata, checks the K-FAC part against the model's blocks
(a checkpoint of another model raises ``ValueError`` before anything is changed), and has
each rank read only what it needs under the *current* placement: the running factors it
keeps (under FSDP2 those of the blocks it decomposes, with DDP every one) and the
decompositions of the blocks it is a gradient worker of. The placement is recomputed at
the current world size, so a checkpoint loads at any world size.

Derived state is saved, not recomputed: the decompositions were computed from the factors
of the last decomposition step, which the running factors have since moved on from, so
recomputing them would change the next steps. Saving them makes resume bit-exact at the
same world size (and at another one the run continues as it would have at that world size,
up to the order of float sums).

Usage::

    kaisa.checkpoint.save("ckpt/step100", model, optimizer, preconditioner)
    ...
    kaisa.checkpoint.load("ckpt/step100", model, optimizer, preconditioner)

Every rank calls both (collectives). With :class:`kaisa.EKFAC` pass it as the optimizer
and no preconditioner. ``docs/distributed.md``, "Checkpoints (DCP)".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypeAlias

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

from kaisa.curvature import KFACCurvature
from kaisa.ekfac import EKFAC
from kaisa.preconditioner import KFACPreconditioner

__all__ = ["FORMAT", "get_state_dict", "kfac_state_dict", "load", "save"]

#: Version of the ``'kfac'`` part's layout.
FORMAT = 1

#: What drives the curvature: a preconditioner, or EKFAC (an optimizer).
Owner: TypeAlias = KFACPreconditioner | EKFAC

_PathLike: TypeAlias = str | os.PathLike[str]

#: A block's factor entries and the side whose decomposing rank owns them.
_FACTOR_SIDE = {"A": "a", "skipped_a": "a", "G": "g", "skipped_g": "g"}


# ---------------------------------------------------------------------- the K-FAC part
def _owner(optimizer: torch.optim.Optimizer, preconditioner: KFACPreconditioner | None) -> Owner:
    """The object whose K-FAC state is checkpointed."""
    if isinstance(optimizer, EKFAC):
        if preconditioner is not None:
            raise ValueError("kaisa.EKFAC keeps its own curvature: pass no preconditioner")
        return optimizer
    if not isinstance(preconditioner, KFACPreconditioner):
        raise ValueError(
            "kaisa.checkpoint needs a kaisa.KFACPreconditioner (with a torch optimizer) or "
            f"a kaisa.EKFAC optimizer, got preconditioner={type(preconditioner).__name__} "
            f"and optimizer={type(optimizer).__name__}"
        )
    return preconditioner


def _core(owner: Owner) -> KFACCurvature:
    return owner.curvature


def _layer_list(core: KFACCurvature) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, str(b.kind), tuple(int(d) for d in b.dims)) for name, b in core.blocks.items()]


def _counters(owner: Owner) -> dict[str, Any]:
    """Steps, refreshes and the schedules' numbers (no tensors)."""
    if isinstance(owner, EKFAC):
        counters: dict[str, Any] = owner.state_dict(include_factors=False)["kaisa"]
        return counters
    return owner.state_dict(include_factors=False)


def _owners(core: KFACCurvature, index: int, name: str) -> dict[str, int]:
    """Which rank writes each of block ``name``'s entries: ``'a'``, ``'g'``, ``'decomposition'``.

    A Kronecker block's factors go with the ranks that decompose them, its decompositions
    with its first gradient worker; a diagonal block (every rank holds it) goes round-robin.
    """
    engine = core.engine
    placed = engine.placement.layers.get(name)
    if placed is None:
        rank = index % engine.world_size
        return {"a": rank, "g": rank, "decomposition": rank}
    return {"a": placed.a_rank, "g": placed.g_rank, "decomposition": placed.grad_workers[0]}


def kfac_state_dict(owner: Owner) -> dict[str, Any]:
    """The K-FAC part of a DCP checkpoint on this rank: what this rank owns (no collective).

    Args:
        owner: A :class:`~kaisa.KFACPreconditioner` or a :class:`~kaisa.EKFAC`.

    Returns:
        ``{'meta': JSON, 'layers': {block: {entry: tensor}}}`` (``'meta'``: the product,
        its blocks, counters and schedules, a string so that DCP keeps it one entry);
        ``'layers'`` holds only the
        entries this rank owns (see the module docstring), the tensors themselves (not
        copies: save them before the next step).
    """
    core = _core(owner)
    rank = core.engine.rank
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for index, (name, block) in enumerate(core.blocks.items()):
        owners = _owners(core, index, name)
        layers[name] = {
            key: t for key, t in block.state_dict().items()
            if isinstance(t, torch.Tensor)
            and owners[_FACTOR_SIDE.get(key, "decomposition")] == rank
        }
    meta = {"format": FORMAT, "product": type(owner).__name__, "layers": _layer_list(core),
            "state": _counters(owner)}
    return {"meta": json.dumps(meta), "layers": layers}


def _check_meta(owner: Owner, meta: object) -> dict[str, Any]:
    """The saved counters, once ``meta`` (JSON) is known to describe ``owner``'s blocks."""
    try:
        meta = json.loads(meta) if isinstance(meta, str) else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise ValueError(f"the checkpoint's kfac.meta is not a kaisa checkpoint of format {FORMAT}")
    product = type(owner).__name__
    if meta.get("product") != product:
        raise ValueError(f"the checkpoint holds the state of a kaisa.{meta.get('product')}, "
                         f"not of a kaisa.{product}")
    mine = {n: (k, d) for n, k, d in _layer_list(_core(owner))}
    try:
        theirs = {str(n): (str(k), tuple(int(d) for d in dims)) for n, k, dims in meta["layers"]}
    except (KeyError, TypeError, ValueError):
        raise ValueError("the checkpoint's kfac.meta has no valid 'layers'") from None
    if theirs != mine:
        changed = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        raise ValueError(
            "the checkpoint's K-FAC blocks do not match this model's (a checkpoint of another "
            f"model?): missing {sorted(set(mine) - set(theirs))}, unexpected "
            f"{sorted(set(theirs) - set(mine))}, of another kind or size "
            f"{[(n, mine[n], theirs[n]) for n in changed]} (here, saved)"
        )
    state = meta.get("state")
    if not isinstance(state, Mapping):
        raise ValueError("the checkpoint's kfac.meta has no 'state'")
    return dict(state)


def _entries(saved: Mapping[str, STORAGE_TYPES], prefix: str) -> dict[str, TensorStorageMetadata]:
    """The tensors saved under ``prefix`` one level down (``prefix`` ends with a dot)."""
    return {fqn[len(prefix):]: md for fqn, md in saved.items()
            if fqn.startswith(prefix) and "." not in fqn[len(prefix):]
            and isinstance(md, TensorStorageMetadata)}


def _layers_template(core: KFACCurvature, saved: Mapping[str, STORAGE_TYPES]
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """Buffers for what this rank reads: the factors it keeps, its gradient-worker blocks' rest."""
    out = {}
    for name, block in core.blocks.items():
        worker, keeps = core.is_grad_worker(name), core.engine.holds_factors(name)
        out[name] = {
            key: torch.empty(md.size, dtype=md.properties.dtype, device=block.weight.device)
            for key, md in _entries(saved, f"kfac.layers.{name}.").items()
            if (keeps if key in _FACTOR_SIDE else worker)
        }
    return out


# ---------------------------------------------------------------------- EKFAC's AdamW part
def _fqns(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model's name of every optimizer parameter, in the optimizer's order."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied one: its first name
    try:
        return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the model's") from None


def _ekfac_optim(model: nn.Module, optimizer: EKFAC) -> dict[str, Any]:
    """EKFAC's torch state keyed by parameter name (``get_optimizer_state_dict``'s layout)."""
    state = torch.optim.Optimizer.state_dict(optimizer)
    fqns = _fqns(model, optimizer)
    return {"state": {fqns[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [fqns[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def _ekfac_optim_template(model: nn.Module, optimizer: EKFAC,
                          saved: Mapping[str, STORAGE_TYPES]) -> dict[str, Any]:
    """Buffers for EKFAC's saved AdamW state: like each parameter (sharded alike)."""
    fqns = _fqns(model, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, p in zip(fqns, params, strict=True):
        entries = _entries(saved, f"optim.state.{fqn}.")
        state[fqn] = {
            key: (torch.zeros_like(p, dtype=md.properties.dtype)
                  if isinstance(p, DTensor) and md.size == p.shape
                  else torch.zeros(md.size, dtype=md.properties.dtype))
            for key, md in entries.items()
        }
    template = _ekfac_optim(model, optimizer)
    return {"state": {k: v for k, v in state.items() if v},
            "param_groups": template["param_groups"]}


def _ekfac_load(model: nn.Module, optimizer: EKFAC, optim: Mapping[str, Any],
                kaisa_state: dict[str, Any]) -> None:
    index = {fqn: i for i, fqn in enumerate(_fqns(model, optimizer))}
    optimizer.load_state_dict({
        "state": {index[fqn]: dict(v) for fqn, v in optim["state"].items()},
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]}
                         for g in optim["param_groups"]],
        "kaisa": kaisa_state,
    })


# ---------------------------------------------------------------------- public API
def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None = None,
) -> dict[str, Any]:
    """This rank's part of a checkpoint, ready for ``torch.distributed.checkpoint.save``.

    Args:
        model: The model (sharded by FSDP2, wrapped in DDP or plain).
        optimizer: The optimizer: a torch optimizer stepped after ``preconditioner``, or a
            :class:`~kaisa.EKFAC`.
        preconditioner: The :class:`~kaisa.KFACPreconditioner` (``None`` with EKFAC).

    Returns:
        ``{'model': ..., 'optim': ..., 'kfac': ...}`` (the module docstring says what each
        holds). Every rank must call it (the model and optimizer parts are collectives
        under FSDP2).
    """
    owner = _owner(optimizer, preconditioner)
    optim = (_ekfac_optim(model, optimizer) if isinstance(optimizer, EKFAC)
             else get_optimizer_state_dict(model, optimizer))
    return {"model": get_model_state_dict(model), "optim": optim, "kfac": kfac_state_dict(owner)}


def save(
    checkpoint_id: _PathLike | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None = None, *,
    storage_writer: StorageWriter | None = None,
) -> None:
    """Saves :func:`get_state_dict` with ``torch.distributed.checkpoint.save`` (every rank).

    Args:
        checkpoint_id: The checkpoint's directory (or what ``storage_writer`` takes).
        model: As for :func:`get_state_dict`.
        optimizer: As for :func:`get_state_dict`.
        preconditioner: As for :func:`get_state_dict`.
        storage_writer: DCP's storage writer (default: a file system one).
    """
    dcp_save(get_state_dict(model, optimizer, preconditioner), checkpoint_id=checkpoint_id,
             storage_writer=storage_writer)


def load(
    checkpoint_id: _PathLike | None, model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None = None, *,
    storage_reader: StorageReader | None = None,
) -> None:
    """Loads a :func:`save` checkpoint into freshly built objects, at any world size.

    Every rank calls it, after building the model (and ``fully_shard``), the optimizer and
    the preconditioner as for training. Each rank reads its shards of the model and the
    optimizer state, the running factors it keeps (under FSDP2: of the blocks it
    decomposes), and the decompositions of the blocks the current
    placement makes it a gradient worker of.

    Args:
        checkpoint_id: The checkpoint's directory (or what ``storage_reader`` takes).
        model: As for :func:`get_state_dict`.
        optimizer: As for :func:`get_state_dict`.
        preconditioner: As for :func:`get_state_dict`.
        storage_reader: DCP's storage reader (default: a file system one).

    Raises:
        ValueError: If the checkpoint has no K-FAC part, or one of another product or
            another set of blocks, or a malformed one; nothing is loaded then.
    """
    owner = _owner(optimizer, preconditioner)
    core = _core(owner)
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError("give a checkpoint_id or a storage_reader")
        storage_reader = FileSystemReader(checkpoint_id)
    saved = storage_reader.read_metadata().state_dict_metadata
    if "kfac.meta" not in saved:
        raise ValueError(f"{checkpoint_id} has no kfac.meta entry: not a kaisa.checkpoint")
    # The K-FAC part first, into new buffers: checked before anything else is touched.
    kfac: dict[str, Any] = {"meta": None, "layers": _layers_template(core, saved)}
    dcp_load({"kfac": kfac}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    layers = kfac["layers"]
    try:
        counters, error = _check_meta(owner, kfac["meta"]), None
        core.check_state_dict(layers)
    except ValueError as err:
        error = str(err)
    # A rank may read entries another does not (its gradient-worker blocks): all or none.
    if core.any_rank(error is not None):
        raise ValueError(error or "kaisa.checkpoint: another rank refused the checkpoint's "
                         "K-FAC state (see its error); nothing was loaded")
    rest: dict[str, Any] = {"model": get_model_state_dict(model),
            "optim": (_ekfac_optim_template(model, optimizer, saved) if isinstance(optimizer, EKFAC)
                      else get_optimizer_state_dict(model, optimizer))}
    dcp_load(rest, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    set_model_state_dict(model, rest["model"])
    if isinstance(optimizer, EKFAC):
        _ekfac_load(model, optimizer, rest["optim"], {**counters, "layers": layers})
        return
    set_optimizer_state_dict(model, optimizer, rest["optim"])
    assert preconditioner is not None
    preconditioner.load_state_dict({**counters, "layers": layers})
