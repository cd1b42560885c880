"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds three parts, keyed by names that do not depend on the world size:

* ``'model'``: :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`
  (under FSDP2 each rank writes its shards of the ``DTensor`` parameters);
* ``'optim'``: the optimizer's state keyed by parameter name, as
  :func:`~torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` gives it
  (for :class:`kaisa.EKFAC`, its AdamW state, and for :class:`kaisa.KFAC`, its
  per-parameter ``velocity``, converted the same way by :mod:`kaisa.checkpoint.optim`;
  KFAC's first-order optimizer's state, for the parameters no block covers, under
  ``'optim.first_order'`` in the same layout);
* ``'kfac'``: the K-FAC state. ``'kfac.meta'`` (every rank the same, written once) holds
  the product, its blocks (name, kind, dims), the step counters and the schedules'
  numbers (and :class:`kaisa.KFAC`'s damping); ``'kfac.generator'`` KFAC's Monte-Carlo
  sampler's state (the same on every rank, written by rank 0);
  ``'kfac.generators.<rank>'`` :class:`kaisa.EKFAC`'s row generator of each rank (seeded
  ``seed + rank``; a rank with none saved, at another world size, keeps its own);
  ``'kfac.layers.<block>.<entry>'`` the tensors. Each rank contributes only
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

Every rank calls both (collectives). With :class:`kaisa.EKFAC` or :class:`kaisa.KFAC`
pass it as the optimizer and no preconditioner. A :class:`kaisa.KFAC` checkpoint is checked
whole (:meth:`kaisa.KFAC.load_state_dict`) before the model is read, so a refused one
changes nothing either. ``docs/distributed.md``, "Checkpoints (DCP)".
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

from kaisa.checkpoint import optim as checkpoint_optim
from kaisa.core.curvature import KFACCurvature
from kaisa.ekfac.optimizer import EKFAC, check_generator_state
from kaisa.kfac.optimizer import KFAC
from kaisa.preconditioner.preconditioner import KFACPreconditioner
from kaisa.utils.finite import all_finite

__all__ = ["FORMAT", "get_state_dict", "kfac_state_dict", "load", "save"]

#: Version of the ``'kfac'`` part's layout.
FORMAT = 1

#: What drives the curvature: a preconditioner, or EKFAC or KFAC (optimizers).
Owner: TypeAlias = KFACPreconditioner | EKFAC | KFAC

_PathLike: TypeAlias = str | os.PathLike[str]

#: A block's factor entries and the side whose decomposing rank owns them.
_FACTOR_SIDE = {"A": "a", "skipped_a": "a", "G": "g", "skipped_g": "g"}


# ---------------------------------------------------------------------- the K-FAC part
def _owner(optimizer: torch.optim.Optimizer, preconditioner: KFACPreconditioner | None) -> Owner:
    """The object whose K-FAC state is checkpointed."""
    if isinstance(optimizer, EKFAC | KFAC):
        if preconditioner is not None:
            raise ValueError(f"kaisa.{type(optimizer).__name__} keeps its own curvature: "
                             "pass no preconditioner")
        return optimizer
    if not isinstance(preconditioner, KFACPreconditioner):
        raise ValueError(
            "kaisa.checkpoint needs a kaisa.KFACPreconditioner (with a torch optimizer), "
            "a kaisa.EKFAC or a kaisa.KFAC optimizer, got "
            f"preconditioner={type(preconditioner).__name__} "
            f"and optimizer={type(optimizer).__name__}"
        )
    return preconditioner


def _core(owner: Owner) -> KFACCurvature:
    return owner.curvature


def _layer_list(core: KFACCurvature) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, str(b.kind), tuple(int(d) for d in b.dims)) for name, b in core.blocks.items()]


def _counters(owner: Owner) -> tuple[dict[str, Any], torch.Tensor | None]:
    """The counters (no tensors) and the product's generator state.

    Counters: steps, refreshes, the schedules' numbers, KFAC's damping. The generator:
    KFAC's Monte-Carlo sampler's, EKFAC's row generator (this rank's); ``None`` for a
    preconditioner.
    """
    if isinstance(owner, EKFAC):
        counters = dict(owner.state_dict(include_factors=False)["kaisa"])
        return counters, counters.pop("generator")
    if not isinstance(owner, KFAC):
        return owner.state_dict(include_factors=False), None
    extra = owner.state_dict()["kaisa"]  # this rank's blocks, not copied: cheap
    counters = {k: v for k, v in extra.items() if k not in ("generator", "first_order")}
    counters["preconditioner"] = {k: v for k, v in extra["preconditioner"].items()
                                  if k != "layers"}
    return counters, extra["generator"]


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
        owner: A :class:`~kaisa.KFACPreconditioner`, a :class:`~kaisa.EKFAC` or a
            :class:`~kaisa.KFAC`.

    Returns:
        ``{'meta': JSON, 'layers': {block: {entry: tensor}}}`` (``'meta'``: the product,
        its blocks, counters and schedules, a string so that DCP keeps it one entry);
        ``'layers'`` holds only the
        entries this rank owns (see the module docstring), the tensors themselves (not
        copies: save them before the next step). For :class:`~kaisa.KFAC` rank 0 adds
        ``'generator'``, the Monte-Carlo sampler's state; for :class:`~kaisa.EKFAC` each
        rank adds ``'generators': {rank: state}``, its row generator's.
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
    counters, generator = _counters(owner)
    meta = {"format": FORMAT, "product": type(owner).__name__, "layers": _layer_list(core),
            "state": counters}
    out: dict[str, Any] = {"meta": json.dumps(meta), "layers": layers}
    if isinstance(owner, EKFAC):  # seeded seed + rank: one per rank
        out["generators"] = {str(rank): generator}
    elif generator is not None and rank == 0:  # the same on every rank: one copy
        out["generator"] = generator
    return out


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


def _layers_template(core: KFACCurvature, saved: Mapping[str, STORAGE_TYPES]
                     ) -> dict[str, dict[str, torch.Tensor]]:
    """Buffers for what this rank reads: the factors it keeps, its gradient-worker blocks' rest."""
    out = {}
    for name, block in core.blocks.items():
        worker, keeps = core.is_grad_worker(name), core.engine.holds_factors(name)
        out[name] = {
            key: torch.empty(md.size, dtype=md.properties.dtype, device=block.weight.device)
            for key, md in checkpoint_optim.entries(saved, f"kfac.layers.{name}.").items()
            if (keeps if key in _FACTOR_SIDE else worker)
        }
    return out


# ---------------------------------------------------------------------- the optimizer part
def _optim(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The ``'optim'`` part: the optimizer's state keyed by parameter name."""
    if not isinstance(optimizer, EKFAC | KFAC):
        return get_optimizer_state_dict(model, optimizer)
    optim = checkpoint_optim.named(model, optimizer)
    if isinstance(optimizer, KFAC) and optimizer.first_order is not None:
        optim["first_order"] = checkpoint_optim.named(model, optimizer.first_order)
    return optim


def _ekfac_load(model: nn.Module, optimizer: EKFAC, optim: Mapping[str, Any],
                kaisa_state: dict[str, Any]) -> None:
    optimizer.load_state_dict({**checkpoint_optim.indexed(model, optimizer, optim),
                               "kaisa": kaisa_state})


def _kfac_load(checkpoint_id: _PathLike | None, storage_reader: StorageReader, model: nn.Module,
               optimizer: KFAC, saved: Mapping[str, STORAGE_TYPES],
               kfac: Mapping[str, Any], counters: dict[str, Any]) -> None:
    """Loads KFAC's optimizer part, checked whole, and then the model.

    In this order a refused checkpoint changes nothing: reading the model writes into its
    parameters.
    """
    optim = checkpoint_optim.template(model, optimizer, saved, "optim.")
    first_order = optimizer.first_order
    saved_first_order = any(k.startswith("optim.first_order.") for k in saved)
    if first_order is not None and saved_first_order:
        optim["first_order"] = checkpoint_optim.template(model, first_order, saved,
                                                         "optim.first_order.")
    dcp_load({"optim": optim}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    extra = {**counters, "preconditioner": {**counters.get("preconditioner", {}),
                                            "layers": kfac["layers"]},
             "generator": kfac.get("generator")}
    if "first_order" in optim:
        assert first_order is not None
        extra["first_order"] = checkpoint_optim.indexed(model, first_order, optim["first_order"])
    elif saved_first_order:  # refused below: this KFAC has no first-order optimizer
        extra["first_order"] = {"state": {}, "param_groups": []}
    # The one check that a rank makes on its shards alone, agreed before anything loads.
    velocity = [t for v in optim["state"].values() for t in v.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if optimizer.curvature.any_rank(not all(bool(all_finite(t)) for t in velocity)):
        raise ValueError("the checkpoint's KFAC optimizer state (velocity) is not finite")
    optimizer.load_state_dict({**checkpoint_optim.indexed(model, optimizer, optim),
                               "kaisa": extra})
    weights = get_model_state_dict(model)
    dcp_load({"model": weights}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    set_model_state_dict(model, weights)


# ---------------------------------------------------------------------- public API
def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None = None,
) -> dict[str, Any]:
    """This rank's part of a checkpoint, ready for ``torch.distributed.checkpoint.save``.

    Args:
        model: The model (sharded by FSDP2, wrapped in DDP or plain).
        optimizer: The optimizer: a torch optimizer stepped after ``preconditioner``, a
            :class:`~kaisa.EKFAC` or a :class:`~kaisa.KFAC`.
        preconditioner: The :class:`~kaisa.KFACPreconditioner` (``None`` with EKFAC or
            KFAC).

    Returns:
        ``{'model': ..., 'optim': ..., 'kfac': ...}`` (the module docstring says what each
        holds). Every rank must call it (the model and optimizer parts are collectives
        under FSDP2).
    """
    owner = _owner(optimizer, preconditioner)
    return {"model": get_model_state_dict(model), "optim": _optim(model, optimizer),
            "kfac": kfac_state_dict(owner)}


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
    generator = saved.get("kfac.generator")
    if isinstance(owner, KFAC) and isinstance(generator, TensorStorageMetadata):
        kfac["generator"] = torch.empty(generator.size, dtype=generator.properties.dtype)
    rows = saved.get(f"kfac.generators.{core.engine.rank}")
    if isinstance(owner, EKFAC) and isinstance(rows, TensorStorageMetadata):
        # This rank's row generator; none saved for it (another world size): kept as is.
        kfac["generators"] = {str(core.engine.rank): torch.empty(
            rows.size, dtype=rows.properties.dtype)}
    dcp_load({"kfac": kfac}, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    layers = kfac["layers"]
    row_state = kfac.get("generators", {}).get(str(core.engine.rank))
    try:
        counters, error = _check_meta(owner, kfac["meta"]), None
        core.check_state_dict(layers)
        if row_state is not None:
            check_generator_state(row_state)
    except ValueError as err:
        error = str(err)
    # A rank may read entries another does not (its gradient-worker blocks): all or none.
    if core.any_rank(error is not None):
        raise ValueError(error or "kaisa.checkpoint: another rank refused the checkpoint's "
                         "K-FAC state (see its error); nothing was loaded")
    if isinstance(optimizer, KFAC):
        _kfac_load(checkpoint_id, storage_reader, model, optimizer, saved, kfac, counters)
        return
    rest: dict[str, Any] = {"model": get_model_state_dict(model),
            "optim": (checkpoint_optim.template(model, optimizer, saved, "optim.")
                      if isinstance(optimizer, EKFAC)
                      else get_optimizer_state_dict(model, optimizer))}
    dcp_load(rest, checkpoint_id=checkpoint_id, storage_reader=storage_reader)
    set_model_state_dict(model, rest["model"])
    if isinstance(optimizer, EKFAC):
        _ekfac_load(model, optimizer, rest["optim"],
                    {**counters, "layers": layers, "generator": row_state})
        return
    set_optimizer_state_dict(model, optimizer, rest["optim"])
    assert preconditioner is not None
    preconditioner.load_state_dict({**counters, "layers": layers})
